"""Shared helpers: build a scheduler, run steps with the stand-in model, check pool invariants."""

from __future__ import annotations

from collections import Counter

import pytest

import worker_groups
from pagefleet.engine.config import CacheConfig, SchedulerConfig
from pagefleet.engine.request import Request, RequestStatus
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.scheduler import Scheduler


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    worker_groups.assign(items)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    listener=None,
    enable_prefix_caching: bool = True,
    **sched_kwargs,
) -> Scheduler:
    sched_kwargs.setdefault("max_model_len", 256)
    budget = sched_kwargs.get("max_num_batched_tokens", SchedulerConfig.max_num_batched_tokens)
    sched_kwargs.setdefault("max_num_seqs", min(SchedulerConfig.max_num_seqs, budget))
    return Scheduler.create(
        SchedulerConfig(**sched_kwargs),
        CacheConfig(
            block_size=block_size,
            num_gpu_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
        listener,
    )


def make_request(
    rid: str,
    prompt: list[int],
    max_tokens: int = 4,
    block_size: int = 4,
    eos_token_id: int | None = None,
    **params,
) -> Request:
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        block_size=block_size,
        eos_token_id=eos_token_id,
    )


def check_invariants(sched: Scheduler) -> None:
    """The pool's books balance: ref counts equal table references, free list and map agree."""
    kv = sched.kv_cache
    pool = kv.pool
    holders = [
        *sched.running,
        *sched.loading.values(),
        *sched.tier_loading.values(),
        *sched.held.values(),
        *sched.quarantined,
    ]
    refs = Counter(block_id for r in holders for block_id in r.block_ids)
    for r in sched.waiting:
        assert not r.block_ids, f"waiting {r} holds blocks"
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.free_queue.num_free
    for block in pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == refs.get(block.block_id, 0), block
        assert (block.ref_cnt == 0) == (block.block_id in set(free_ids)), block
    for h, block in pool.cached.items():
        assert block.block_hash == h
    assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached)
    assert pool.num_cached_free == sum(1 for b in pool.free_queue if b.block_hash is not None)
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert r.num_computed_tokens <= len(r.block_ids) * kv.block_size
        assert r.num_cached_blocks <= len(r.block_ids)
    assert len(sched.running) <= sched.config.max_num_seqs


def full_prefix_hit_step(llm):
    """A request whose whole prompt (two full blocks) is cached, scheduled: its step recomputes
    the last token alone, whose key and value are in a shared block already. Returns the
    step, the request, and the next token the first run gave."""
    prompt = list(range(40, 72))  # two full blocks
    one = SamplingParams(temperature=0, max_tokens=1)
    first = llm.generate([prompt], one, use_tqdm=False)[0]
    llm.engine.add_request("again", prompt, SamplingParams(temperature=0, max_tokens=2))
    out = llm.engine.scheduler.schedule()
    ((req, n),) = out.scheduled
    assert n == 1 and req.num_cached_tokens == 32
    return out, req, first.outputs[0].token_ids[0]


@pytest.fixture
def scheduler_factory():
    return make_scheduler


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """One tiny random checkpoint per supported architecture (see hf_reference.ARCH_CASES)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hf_reference import ARCH_CASES
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: str(write_tiny_checkpoint(root / name, arch, **opts))
        for name, (arch, opts) in ARCH_CASES.items()
    }


@pytest.fixture(scope="session")
def hybrid_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny random Qwen3.5 checkpoints (see hf_reference.HYBRID_CASES)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hf_reference import HYBRID_CASES
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("hybrid_checkpoints")
    return {
        name: str(write_tiny_checkpoint(root / name, arch, **opts))
        for name, (arch, opts) in HYBRID_CASES.items()
    }


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory) -> dict[str, str]:
    """One tiny random checkpoint per mixture-of-experts case (hf_reference.MOE_CASES)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hf_reference import MOE_CASES
    from pagefleet.engine.model.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("moe-checkpoints")
    return {
        name: str(write_tiny_checkpoint(root / name, arch, **opts))
        for name, (arch, opts) in MOE_CASES.items()
    }


@pytest.fixture(scope="session")
def interpreter():
    """One worker process for the whole run whose Triton kernels run in the interpreter on CPU
    tensors (Triton picks interpreter or compiler when a kernel module is first imported, so it
    cannot be this process: see triton_interpret_cases.py). Shared by every Triton test file:
    one spawn and one import of torch and Triton, not one per file."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import triton_interpret_cases

    context = multiprocessing.get_context("spawn")
    init = triton_interpret_cases.enable_interpreter
    with ProcessPoolExecutor(1, mp_context=context, initializer=init) as pool:
        yield lambda fn, *args, **kwargs: pool.submit(fn, *args, **kwargs).result(timeout=300)


@pytest.fixture
def tile_calls(monkeypatch) -> list[int]:
    """The rows of every step the 4-bit tiles take (quant/int4_tiles.py), as they run."""
    from pagefleet.engine.model.quant import int4_tiles

    calls: list[int] = []
    original = int4_tiles.Int4Tiles.__call__
    monkeypatch.setattr(
        int4_tiles.Int4Tiles, "__call__", lambda self, x: calls.append(len(x)) or original(self, x)
    )
    return calls
