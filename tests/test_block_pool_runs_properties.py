"""Property tests of BlockPool.allocate_runs on random histories of allocations, prefix caching,
frees, revivals and resets: no block is handed out twice, the id-indexed mirrors of the O(1)
free list stay exact, a run is returned whenever the candidates hold one, and the cached
prefixes it evicts all lie in its window: the RUN_WINDOW * n least recently used free blocks
(plain `allocate` evicts only from its own LRU head's n).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_block_pool import count_runs

from pagefleet.engine.kv_cache import BlockPool, BlockRemoved
from pagefleet.engine.kv_cache.block_pool import RUN_WINDOW

NUM_BLOCKS = 24

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(1, 6)),
        st.tuples(st.just("allocate_runs"), st.integers(0, 12)),
        st.tuples(st.just("cache"), st.integers(0, 100)),
        st.tuples(st.just("free"), st.integers(0, 100)),
        st.tuples(st.just("touch"), st.integers(0, 100)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    max_size=60,
)


def _lru_victims(pool: BlockPool, n: int) -> set[bytes]:
    """The hashes among the LRU head's n free blocks: all that `allocate(n)` may evict now."""
    head = [b for _, b in zip(range(n), pool.free_queue, strict=False)]
    return {b.block_hash for b in head if b.block_hash is not None}


def _has_run(pool: BlockPool, n: int) -> bool:
    """Whether uncached free blocks plus the LRU head's window hold n consecutive ids."""
    candidates = {b.block_id for b in pool.free_queue if b.block_hash is None}
    head = zip(range(RUN_WINDOW * n), pool.free_queue, strict=False)
    candidates |= {b.block_id for _, b in head}
    return any(all(i + k in candidates for k in range(n)) for i in candidates)


def _check_books(pool: BlockPool, holders: list[list[int]]) -> None:
    held = [i for h in holders for i in h]
    refs = {i: 0 for i in range(NUM_BLOCKS)}
    for i in held:
        refs[i] += 1
    queued = [b.block_id for b in pool.free_queue]
    assert len(queued) == len(set(queued)) == pool.num_free_blocks
    assert all(pool.blocks[i].ref_cnt == refs[i] for i in refs)
    assert set(queued) == {i for i, r in refs.items() if r == 0}
    assert [i for i, m in enumerate(pool.free_queue.members) if m] == sorted(queued)
    assert [i for i, h in enumerate(pool.hashed) if h] == sorted(
        b.block_id for b in pool.cached.values()
    )
    assert all(b.block_hash == h for h, b in pool.cached.items())
    assert pool.num_cached_free == sum(1 for b in pool.free_queue if b.block_hash is not None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_allocate_runs_keeps_every_promise_of_the_pool(ops):
    events: list = []
    pool = BlockPool(NUM_BLOCKS, listener=events.append)
    holders: list[list[int]] = []  # each a request's block table
    next_hash = 0
    for op, arg in ops:
        if op in ("allocate", "allocate_runs"):
            if arg > pool.num_free_blocks:
                continue
            victims = _lru_victims(pool, arg * (RUN_WINDOW if op == "allocate_runs" else 1))
            expect_run = arg > 0 and _has_run(pool, arg)
            events.clear()
            got = getattr(pool, op)(arg)
            assert len(got) == len(set(got)) == arg
            assert not set(got) & {i for h in holders for i in h}, "a block handed out twice"
            evicted = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
            assert evicted <= victims, "evicted a prefix more recently used than the window"
            if op == "allocate_runs":
                assert not expect_run or count_runs(got) == 1
                assert got == sorted(got)
            holders.append(got)
        elif op == "cache" and holders:
            table = holders[arg % len(holders)]
            hashes = [next_hash + k for k in range(len(table))]
            next_hash += len(table)
            pool.cache_blocks(table, [h.to_bytes(4, "big") for h in hashes], None, hashes, 1)
        elif op == "free" and holders:
            pool.free(holders.pop(arg % len(holders)))
        elif op == "touch" and pool.cached:
            cached = sorted(pool.cached)
            block = pool.cached[cached[arg % len(cached)]]
            pool.touch([block])
            holders.append([block.block_id])
        elif op == "reset":
            pool.reset_prefix_cache()
        _check_books(pool, holders)
