"""`--attention-backend auto` on CPU: the torch gather path or the in-place numba kernel, by
timing both on this model's decode shape on this machine.

Which is faster depends on the CPU, the head layout and the threads (docs/benchmarks.md,
issues 22 and 38), so `auto` times the decode attention of both backends (`_single`, what a
decode step runs per layer) at 1, 16 and 64 rows of CONTEXT tokens each, over block tables
scattered through a pool of POOL_BYTES, and the pure rule (cpu_choice/decide.py)
keeps torch, the default, unless numba wins by its margin. The times are kept per CPU model
(cpu_choice/measure.py): a machine measures each shape once. Pools the kernel does not read
(fp8, float16) stay on torch without measuring.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from pagefleet.engine.attention.backend import DecodeShape, SingleGroup
from pagefleet.engine.cpu_choice.decide import Choice, Timed, choose
from pagefleet.engine.cpu_choice.measure import TimingCache, cached_timings, time_alternately

logger = logging.getLogger(__name__)

CANDIDATES = ("torch", "numba")
DEFAULT = "torch"  # needs no measurement to be safe: a tie or a failure keeps it
ROWS = (1, 16, 64)
CONTEXT = 256  # tokens each measured row attends to
POOL_BYTES = 64 << 20  # keys plus values of the measuring pool (more where 64 rows need it)


def cpu_backend_choice(shape: DecodeShape, cache: TimingCache | None = None) -> Choice:
    """torch or numba for this shape (see the module docstring), logged with the reason."""
    from pagefleet.engine.attention.numba_paged import KERNEL_DTYPES

    if shape.kv_dtype not in KERNEL_DTYPES:
        choice = Choice(DEFAULT, f"{DEFAULT}: the in-place kernel does not read {shape.kv_dtype}")
    else:
        cache = cache if cache is not None else TimingCache()
        timings, source = cached_timings(cache, shape.subject(), lambda: measure(shape))
        choice = choose(CANDIDATES, DEFAULT, timings)
        choice = Choice(choice.name, f"{choice.reason} ({source})")
    logger.info("attention backend for %s: %s", shape.subject(), choice.reason)
    return choice


def measure(shape: DecodeShape) -> list[Timed]:
    """Seconds per decode attention call of each backend at each of ROWS."""
    from pagefleet.engine.attention.numba_paged import NumbaAttentionBackend
    from pagefleet.engine.attention.torch_ref import TorchAttentionBackend

    backends = {"torch": TorchAttentionBackend(), "numba": NumbaAttentionBackend()}
    blocks_per_row = -(-CONTEXT // shape.block_size)
    block_bytes = shape.num_kv_heads * shape.block_size * shape.head_dim * 2
    block_bytes *= torch.tensor([], dtype=shape.kv_dtype).element_size()
    num_blocks = max(max(ROWS) * blocks_per_row, POOL_BYTES // block_bytes)
    pool_shape = (shape.num_kv_heads, num_blocks, shape.block_size, shape.head_dim)
    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(pool_shape, generator=generator).to(shape.kv_dtype)
    v_cache = torch.randn(pool_shape, generator=generator).to(shape.kv_dtype)
    scale = shape.head_dim**-0.5
    timings = []
    for rows in ROWS:
        order = torch.randperm(num_blocks, generator=generator)[: rows * blocks_per_row]
        tables = order.view(rows, blocks_per_row)
        width = blocks_per_row * shape.block_size
        lens = torch.full((rows,), CONTEXT, dtype=torch.int64)
        mask = (torch.arange(width) < CONTEXT).expand(rows, width).reshape(1, rows, 1, width)
        group = SingleGroup(0, rows, tables, mask, lens)
        q = torch.randn(rows, shape.num_heads, shape.head_dim, generator=generator)
        q = q.to(shape.dtype)
        calls = {
            name: partial(b._single, q, k_cache, v_cache, group, scale, None)
            for name, b in backends.items()
        }
        timings.append(Timed(f"rows={rows}", time_alternately(calls)))
    return timings
