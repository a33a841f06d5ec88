"""The block pool: LRU eviction order, revival of cached free blocks, tail-first freeing, events."""

from __future__ import annotations

import pytest

from pagefleet.engine.kv_cache import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeBlockQueue,
)
from pagefleet.engine.kv_cache.block_pool import Block


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
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
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
    assert first is a[1]
    assert b"a1" not in pool.cached and b"a0" in pool.cached
    assert events[-1] == BlockRemoved([b"a1"])
    assert pool.num_cached_free == 3


def test_cached_free_block_is_revived_by_touch():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [b"x", b"y"], None, list(range(8)), 4)
    pool.free(blocks)
    assert pool.num_free_blocks == 3
    hit = pool.lookup(b"x")
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 2 and pool.num_cached_free == 1
    # The revived block is no longer evictable: the next allocations skip it.
    others = pool.allocate(2)
    assert hit not in others
    assert pool.lookup(b"x") is hit and pool.lookup(b"y") is None


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(1)[0], pool.allocate(1)[0]
    pool.cache_blocks([a], [b"h"], None, [1, 2], 2)
    pool.cache_blocks([b], [b"h"], None, [1, 2], 2)
    assert pool.lookup(b"h") is a and b.block_hash is None


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
    assert held[0].ref_cnt == 1 and held[0].block_hash is None


def test_a_pool_needs_one_block_and_starts_with_every_block_free_and_unreferenced():
    """Fails for: a one-block pool refused, blocks born referenced, the refusal unexplained."""
    pool = BlockPool(1)
    assert pool.num_free_blocks == 1 and pool.blocks[0].ref_cnt == 0
    assert pool.allocate(1)[0].block_id == 0
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
    assert again.block_hash is None and pool.num_cached_free == 0
    pool.free([again])
    assert pool.num_cached_free == 0 and pool.usage() == 0.0


def test_touching_several_cached_free_blocks_counts_each():
    """Fails for: the cached-free count set instead of decremented."""
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, [b"a", b"b", b"c"], None, [1, 2, 3], 1)
    pool.free(blocks)
    pool.touch(blocks[:1])
    assert pool.num_cached_free == 2
    pool.touch(blocks[:2])
    assert pool.num_cached_free == 1
    pool.touch(blocks[:2])  # already referenced: only the count of references moves
    assert pool.num_cached_free == 1 and [b.ref_cnt for b in blocks] == [3, 2, 0]


def test_cache_blocks_refuses_a_hash_list_of_another_length():
    """One hash per block: a mismatch is a caller bug, not something to truncate silently."""
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.cache_blocks(pool.allocate(2), [b"only-one"], None, [1, 2], 1)


def test_block_repr_shows_id_references_and_whether_cached():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_blocks([a], [b"h"], None, [1], 1)
    assert repr(a) == "Block(id=0, ref=1, cached=True)"
    assert repr(b) == "Block(id=1, ref=1, cached=False)"
