"""The block pool: LRU eviction order, revival of cached free blocks, tail-first freeing, events."""

from __future__ import annotations

from itertools import pairwise

import pytest

from pagefleet.engine.kv_cache import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeBlockQueue,
)
from pagefleet.engine.kv_cache.block_pool import RUN_WINDOW, Block


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert q.popleft().block_id == 0
    assert len(q) == 4
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_allocate_takes_from_the_head_and_is_all_or_nothing():
    pool = BlockPool(4)
    got = pool.allocate(3)
    assert got == [0, 1, 2]
    assert all(pool.blocks[i].ref_cnt == 1 for i in got)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_least_recently_freed_cached_block_is_evicted_first():
    events = []
    pool = BlockPool(4, listener=events.append)
    a = pool.allocate(2)
    b = pool.allocate(2)
    pool.cache_blocks(a, [b"a0", b"a1"], None, list(range(8)), 4)
    pool.cache_blocks(b, [b"b0", b"b1"], None, list(range(8)), 4)
    pool.free(a)  # freed first: evicted first
    pool.free(b)
    assert pool.num_cached_free == 4 and pool.usage() == 0.0
    # Tail-first freeing: a1 went to the free list before a0, so it is evicted before a0.
    first = pool.allocate(1)[0]
    assert first == a[1]
    assert b"a1" not in pool.cached and b"a0" in pool.cached
    assert events[-1] == BlockRemoved([b"a1"])
    assert pool.num_cached_free == 3


def test_cached_free_block_is_revived_by_touch():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [b"x", b"y"], None, list(range(8)), 4)
    pool.free(blocks)
    assert pool.num_free_blocks == 3
    hit = pool.cached[b"x"]
    assert hit.block_id == blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 2 and pool.num_cached_free == 1
    # The revived block is no longer evictable: the next allocations skip it.
    others = pool.allocate(2)
    assert hit.block_id not in others
    assert pool.cached.get(b"x") is hit and b"y" not in pool.cached


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(1)[0], pool.allocate(1)[0]
    pool.cache_blocks([a], [b"h"], None, [1, 2], 2)
    pool.cache_blocks([b], [b"h"], None, [1, 2], 2)
    assert pool.cached[b"h"].block_id == a and pool.blocks[b].block_hash is None


def test_block_stored_event_carries_parent_and_tokens():
    events = []
    pool = BlockPool(4, listener=events.append)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [b"h1", b"h2"], b"h0", [5, 6, 7, 8], 2)
    assert events == [BlockStored([b"h1", b"h2"], b"h0", [5, 6, 7, 8], 2)]


def test_reset_prefix_cache_drops_every_hash_and_emits_cleared():
    events = []
    pool = BlockPool(4, listener=events.append)
    held = pool.allocate(1)
    freed = pool.allocate(1)
    pool.cache_blocks(held + freed, [b"p", b"q"], None, [1, 2], 1)
    pool.free(freed)
    assert pool.reset_prefix_cache() == 2
    assert events[-1] == AllBlocksCleared()
    assert not pool.cached and pool.num_cached_free == 0
    block = pool.blocks[held[0]]
    assert block.ref_cnt == 1 and block.block_hash is None


def test_a_pool_needs_one_block_and_starts_with_every_block_free_and_unreferenced():
    """Fails for: a one-block pool refused, blocks born referenced, the refusal unexplained."""
    pool = BlockPool(1)
    assert pool.num_free_blocks == 1 and pool.blocks[0].ref_cnt == 0
    assert pool.allocate(1) == [0]
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        BlockPool(0)
    with pytest.raises(ValueError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    assert all(b.ref_cnt == 0 for b in BlockPool(3).blocks)


def test_an_empty_free_queue_says_so():
    """Fails for: sentinels not linked (an AttributeError instead of IndexError)."""
    with pytest.raises(IndexError, match=r"^no free block$"):
        FreeBlockQueue([]).popleft()


def test_eviction_forgets_the_hash_so_a_reused_block_is_not_counted_as_cached():
    """An evicted block's hash is cleared: freed again it is plain free space. Fails for: the
    hash set to anything but None (the block counts as cached-free forever)."""
    pool = BlockPool(1)
    (block,) = pool.allocate(1)
    pool.cache_blocks([block], [b"h"], None, [1], 1)
    pool.free([block])
    assert pool.num_cached_free == 1
    (again,) = pool.allocate(1)  # evicts h
    assert pool.blocks[again].block_hash is None and pool.num_cached_free == 0
    pool.free([again])
    assert pool.num_cached_free == 0 and pool.usage() == 0.0


def test_touching_several_cached_free_blocks_counts_each():
    """Fails for: the cached-free count set instead of decremented."""
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, [b"a", b"b", b"c"], None, [1, 2, 3], 1)
    pool.free(blocks)
    pool.touch([pool.blocks[i] for i in blocks[:1]])
    assert pool.num_cached_free == 2
    pool.touch([pool.blocks[i] for i in blocks[:2]])
    assert pool.num_cached_free == 1
    pool.touch(
        [pool.blocks[i] for i in blocks[:2]]
    )  # already referenced: only the count of references moves
    assert pool.num_cached_free == 1 and [pool.blocks[i].ref_cnt for i in blocks] == [3, 2, 0]


def test_cache_blocks_refuses_a_hash_list_of_another_length():
    """One hash per block: a mismatch is a caller bug, not something to truncate silently."""
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.cache_blocks(pool.allocate(2), [b"only-one"], None, [1, 2], 1)


def test_block_repr_shows_id_references_and_whether_cached():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_blocks([a], [b"h"], None, [1], 1)
    assert repr(pool.blocks[a]) == "Block(id=0, ref=1, cached=True)"
    assert repr(pool.blocks[b]) == "Block(id=1, ref=1, cached=False)"


def _pool_freed_in_order(num_blocks: int, order: list[int], cached: dict[int, bytes] = {}):  # noqa: B006
    """A pool whose every block was taken one at a time, `cached` ones given hashes, then the
    blocks of `order` freed one by one (so the LRU list is `order`, the rest stay in use)."""
    events: list = []
    pool = BlockPool(num_blocks, listener=events.append)
    for block_id in pool.allocate(num_blocks):
        if block_id in cached:
            pool.cache_blocks([block_id], [cached[block_id]], None, [block_id], 1)
    for block_id in order:
        pool.free([block_id])
    events.clear()
    return pool, events


def count_runs(ids: list[int]) -> int:
    """Runs of ids going up by one (the test's own count, independent of the pool's)."""
    return 1 + sum(1 for a, b in pairwise(ids) if b != a + 1)


def _check_books(pool: BlockPool) -> None:
    """The id-indexed mirrors agree with the linked list and the blocks' own state."""
    queued = [b.block_id for b in pool.free_queue]
    assert len(queued) == len(set(queued)) == pool.num_free_blocks
    assert [i for i, m in enumerate(pool.free_queue.members) if m] == sorted(queued)
    assert all((b.ref_cnt == 0) == (b.block_id in set(queued)) for b in pool.blocks)
    assert [i for i, h in enumerate(pool.hashed) if h] == sorted(
        b.block_id for b in pool.cached.values()
    )
    assert pool.num_cached_free == sum(1 for b in pool.free_queue if b.block_hash is not None)


def test_allocate_runs_takes_a_run_where_allocate_takes_the_scattered_lru_head():
    """Fails for: transfer destinations taken in LRU order (one descriptor per block)."""
    pool, _ = _pool_freed_in_order(10, [5, 1, 6, 2, 7, 3])
    twin, _ = _pool_freed_in_order(10, [5, 1, 6, 2, 7, 3])
    assert twin.allocate(3) == [5, 1, 6]
    assert pool.allocate_runs(3) == [1, 2, 3]
    assert all(pool.blocks[i].ref_cnt == 1 for i in (1, 2, 3))
    _check_books(pool)
    # The rest of the LRU order is untouched: plain allocation continues with it.
    assert pool.allocate(3) == [5, 6, 7]
    _check_books(pool)


def test_allocate_runs_prefers_the_shortest_run_that_fits():
    """Best fit keeps the long run whole for a long transfer. Fails for: first fit."""
    pool, _ = _pool_freed_in_order(12, [0, 1, 2, 3, 4, 7, 8, 10])
    assert pool.allocate_runs(2) == [7, 8]
    assert pool.allocate_runs(5) == [0, 1, 2, 3, 4]
    _check_books(pool)


def test_allocate_runs_falls_back_to_the_fewest_runs_when_fragmented():
    """No run holds n: the longest runs first, each ascending, never a block twice."""
    pool, _ = _pool_freed_in_order(10, [9, 0, 2, 3, 5, 6, 7])
    got = pool.allocate_runs(6)
    assert got == [0, 2, 3, 5, 6, 7]
    assert count_runs(got) == 3
    assert pool.allocate_runs(1) == [9]
    with pytest.raises(ValueError, match="asked for 1 blocks, 0 free"):
        pool.allocate_runs(1)
    assert pool.allocate_runs(0) == []
    _check_books(pool)


def test_allocate_runs_uses_uncached_free_blocks_before_evicting_any_prefix():
    """Fails for: a run over the cached LRU head chosen when free uncached blocks hold one."""
    hashes = {i: bytes([65 + i]) for i in range(6)}
    pool, events = _pool_freed_in_order(8, [5, 4, 3, 2, 1, 0, 6, 7], hashes)
    assert pool.allocate_runs(2) == [6, 7]
    assert events == [] and len(pool.cached) == 6 and pool.num_cached_free == 6
    _check_books(pool)


def _evictions(pool: BlockPool, take) -> tuple[list[int], set[bytes]]:
    """The ids `take(pool)` returns and the hashes its BlockRemoved events name."""
    events: list = []
    pool.listener = events.append
    got = take(pool)
    return got, {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}


def test_allocate_runs_with_window_one_evicts_only_what_allocate_would():
    """Window 1: candidates are the uncached blocks plus the LRU head's n, so the evicted
    hashes are a subset of plain allocation's. Fails for: any cached block in id order
    evicted (a younger prefix lost while an older one survives)."""
    hashes = {i: bytes([65 + i]) for i in range(10) if i not in (3, 7)}
    order = [9, 8, 3, 2, 1, 0, 7, 6, 5, 4]
    pool, _ = _pool_freed_in_order(10, order, hashes)
    twin, _ = _pool_freed_in_order(10, order, hashes)
    offered, twin_offered = [], []
    pool.on_evict, twin.on_evict = offered.extend, twin_offered.extend
    _, twin_removed = _evictions(twin, lambda p: p.allocate(4))  # 9, 8, 2 (3 has no hash)
    got, removed = _evictions(pool, lambda p: p.allocate_runs(4, window=1))
    assert got == [2, 7, 8, 9]  # candidates {3, 7} + head {9, 8, 3, 2}: runs 7-9 and 2
    assert removed <= twin_removed
    assert {h for h, _ in offered} == removed
    assert set(offered) <= set(twin_offered)
    for block_id, h in hashes.items():
        if block_id not in got:
            assert pool.cached[h].block_id == block_id  # every other prefix is still reusable
    _check_books(pool)


def test_allocate_runs_window_trades_only_the_oldest_prefixes_for_longer_runs():
    """The default window (RUN_WINDOW * n of the LRU head) finds a run that window 1 cannot,
    and every prefix used more recently than the window stays cached. Fails for: a window
    of n (two runs here), or candidates reaching past the window (the run 0-2, freed last,
    comes first by id)."""
    assert RUN_WINDOW == 2
    order = [5, 10, 6, 11, 7, 12, 0, 1, 2]
    hashes = {i: bytes([65 + i]) for i in order}
    narrow, _ = _pool_freed_in_order(14, order, hashes)
    assert count_runs(narrow.allocate_runs(3, window=1)) == 2  # head {5, 10, 6}
    pool, _ = _pool_freed_in_order(14, order, hashes)
    got, removed = _evictions(pool, lambda p: p.allocate_runs(3))
    assert got == [5, 6, 7]  # head {5, 10, 6, 11, 7, 12}: runs 5-7 and 10-12
    assert removed == {hashes[i] for i in got}
    window = set(order[: RUN_WINDOW * 3])
    for block_id, h in hashes.items():
        if block_id not in window:
            assert pool.cached[h].block_id == block_id
    _check_books(pool)


def test_blocks_taken_by_allocate_runs_free_and_revive_like_any_other():
    """A transfer's blocks cached and freed are prefix hits later, and the books balance."""
    pool, _ = _pool_freed_in_order(6, [4, 0, 5, 1])
    got = pool.allocate_runs(2)
    assert got == [0, 1]
    pool.cache_blocks(got, [b"p0", b"p1"], None, [1, 2], 1)
    pool.free(got)
    _check_books(pool)
    hit = pool.cached[b"p0"]
    pool.touch([hit])
    assert hit.block_id == 0 and hit.ref_cnt == 1
    pool.reset_prefix_cache()
    _check_books(pool)
    assert pool.allocate_runs(3) == [1, 4, 5]
    _check_books(pool)
