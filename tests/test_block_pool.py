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
