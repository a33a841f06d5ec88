"""`--attention-backend auto` on CPU: the torch gather path or the in-place numba kernel, by
timing both on this model's decode shape on this machine.

Which is faster depends on the CPU, the head layout and the threads (docs/benchmarks.md,
issues 22 and 38), so `auto` times the decode attention of both backends (`_single` over the
groups the runner makes: what a decode step runs per layer) at 1, 16 and 64 rows of CONTEXT
tokens each, their blocks drawn at random from a pool of POOL_BYTES, and the pure rule
(cpu_choice/decide.py) keeps torch, the default, unless numba wins by its margin (or fails to
build here). The times are kept per CPU model (cpu_choice/measure.py): a machine measures each
shape once. Pools the kernel does not read (fp8, float16) stay on torch without measuring.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from pagefleet.engine.attention.backend import (
    NUMBA_KV_DTYPES,
    DecodeShape,
    SingleGroup,
    single_groups,
)
from pagefleet.engine.cpu_choice.decide import Choice, Timed, choose
from pagefleet.engine.cpu_choice.measure import TimingCache, cached_timings, time_alternately

logger = logging.getLogger(__name__)

CANDIDATES = ("torch", "numba")
DEFAULT = "torch"  # needs no measurement to be safe: a tie or a failure keeps it
ROWS = (1, 16, 64)
CONTEXT = 256  # tokens each measured row attends to
POOL_BYTES = 64 << 20  # keys plus values of the measuring pool (one row's blocks at least)


def cpu_backend_choice(shape: DecodeShape, cache: TimingCache | None = None) -> Choice:
    """torch or numba for this shape (see the module docstring), logged with the reason."""
    if shape.kv_dtype not in NUMBA_KV_DTYPES:
        choice = Choice(DEFAULT, f"{DEFAULT}: the in-place kernel does not read {shape.kv_dtype}")
    else:
        cache = cache if cache is not None else TimingCache()
        timings, source = cached_timings(cache, shape.subject(), lambda: measure(shape))
        choice = choose(CANDIDATES, DEFAULT, timings)
        choice = Choice(choice.name, f"{choice.reason} ({source})")
    logger.info("attention backend for %s: %s", shape.subject(), choice.reason)
    return choice


def measure(shape: DecodeShape) -> list[Timed]:
    """Seconds per step of decode attention (one layer's groups, as the runner makes them) of
    each backend at each of ROWS; numba's times None where its kernel cannot be built here."""
    from pagefleet.engine.attention.torch_ref import TorchAttentionBackend

    backends = {"torch": TorchAttentionBackend(), "numba": _numba_backend(shape.kv_dtype)}
    bs = shape.block_size
    blocks_per_row = -(-CONTEXT // bs)
    itemsize = torch.empty((), dtype=shape.kv_dtype).element_size()
    block_bytes = 2 * shape.num_kv_heads * bs * shape.head_dim * itemsize
    num_blocks = max(blocks_per_row, POOL_BYTES // block_bytes)
    generator = torch.Generator().manual_seed(0)
    pool = torch.empty(2, shape.num_kv_heads, num_blocks, bs, shape.head_dim, dtype=shape.kv_dtype)
    k_cache, v_cache = pool.normal_(generator=generator).unbind(0)
    scale = shape.head_dim**-0.5
    timings = []
    for rows in ROWS:
        # Blocks drawn at random (with replacement where the pool is smaller than the rows').
        tables = torch.randint(num_blocks, (rows, blocks_per_row), generator=generator)
        lens = torch.full((rows,), CONTEXT, dtype=torch.int64)
        groups = single_groups(tables.tolist(), lens, bs, torch.device("cpu"))
        q = torch.randn(rows, shape.num_heads, shape.head_dim, generator=generator)
        q = q.to(shape.dtype)
        calls = {
            name: partial(_attend, backend, q, k_cache, v_cache, groups, scale)
            for name, backend in backends.items()
            if backend is not None
        }
        seconds = time_alternately(calls)
        timings.append(Timed(f"rows={rows}", {name: seconds.get(name) for name in CANDIDATES}))
    return timings


def _numba_backend(kv_dtype: torch.dtype):
    """The numba backend, or None where numba or its kernel fails here (an import or a
    compile error of any kind: the choice then keeps torch, saying that numba failed)."""
    try:
        from pagefleet.engine.attention.numba_paged import NumbaAttentionBackend

        return NumbaAttentionBackend(kv_dtype)
    except Exception as e:  # whatever numba raises, torch still serves
        logger.warning("the in-place attention kernel is unavailable: %r", e)
        return None


def _attend(backend, q, k_cache, v_cache, groups: list[SingleGroup], scale: float) -> None:
    for group in groups:
        backend._single(q[group.start : group.end], k_cache, v_cache, group, scale, None)
