"""The block pool: every KV block, an LRU free list, and the hash -> block map of prefix caching.

Free blocks sit in an intrusive doubly linked list (links live on the blocks themselves), so
taking a cached block out of the middle on a prefix hit is O(1) and the hot path allocates
nothing. Blocks are evicted from the head; freed blocks join at the tail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagefleet.common.block_hash import BlockHash
from pagefleet.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventListener,
)


class Block:
    """One page of `block_size` token slots in the KV pool."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is full, computed and registered in the cache map.
        self.block_hash: BlockHash | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """Doubly linked LRU list of free blocks with sentinels; O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """Owns all blocks: allocation, reference counts, the prefix-cache map and KV events."""

    def __init__(self, num_blocks: int, listener: KVEventListener | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.listener = listener
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        # Free blocks that still hold a reusable hash: counted apart from "usage".
        self.num_cached_free = 0
        # Told (hash, block_id) of cached blocks about to be reused (the offload tier keeps them).
        self.on_evict: Callable[[list[tuple[BlockHash, int]]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (cached-but-free blocks excluded)."""
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the LRU head, evicting their cached hashes; returns their ids.
        The caller checked there is space."""
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        out = []
        evicted: list[BlockHash] = []
        offered: list[tuple[BlockHash, int]] = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                offered.append((block.block_hash, block.block_id))
                del self.cached[block.block_hash]
                block.block_hash = None
                self.num_cached_free -= 1
            block.ref_cnt = 1
            out.append(block.block_id)
        if evicted and self.listener is not None:
            self.listener(BlockRemoved(evicted))
        if offered and self.on_evict is not None:
            self.on_evict(offered)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found by a prefix hit, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_cached_free -= 1  # only cached blocks can be hit
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, last block first, so chains are evicted tail-first."""
        blocks = self.blocks
        for block_id in reversed(block_ids):
            block = blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free += 1

    def cache_blocks(
        self,
        block_ids: list[int],
        hashes: list[BlockHash],
        parent: BlockHash | None,
        token_ids: list[int],
        block_size: int,
    ) -> None:
        """Register full, computed blocks under their hashes (one hash per block).

        A hash already cached by another block (two requests computed the same block at once)
        keeps its first block; the duplicate stays private and is freed like any other. Every
        hash is announced either way: after the call this engine holds all of them.
        """
        cached, blocks = self.cached, self.blocks
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            block = blocks[block_id]
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block
        if self.listener is not None:
            self.listener(BlockStored(list(hashes), parent, token_ids, block_size))

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash; returns how many were dropped. Blocks in use stay allocated."""
        n = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self.num_cached_free = 0
        if self.listener is not None:
            self.listener(AllBlocksCleared())
        return n
