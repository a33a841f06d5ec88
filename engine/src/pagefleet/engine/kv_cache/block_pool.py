"""The block pool: every KV block, an LRU free list, and the hash -> block map of prefix caching.

Free blocks sit in an intrusive doubly linked list (links live on the blocks themselves), so
taking a cached block out of the middle on a prefix hit is O(1) and the hot path allocates
nothing. Blocks are evicted from the head; freed blocks join at the tail.

A second path, `allocate_runs`, serves both ends of a KV transfer (a P/D pull's destination
and a prefill pod's blocks that will be read): it takes blocks in runs of consecutive ids (one
NIXL descriptor per run and plane instead of per block), evicting only among the
`RUN_WINDOW * n` least recently used free blocks.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable, Sequence
from itertools import islice

import numpy as np

from pagefleet.common.block_hash import BlockHash
from pagefleet.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventListener,
)

# allocate_runs(n) may evict any of the RUN_WINDOW * n least recently used free blocks, not only
# the n that allocate(n) would. Measured on simulated churned pools (benchmarks/kv_transfer.py,
# 512 of 2048 blocks, prefix caching): with both P/D sides allocating in runs a pull's merged
# run count falls from ~90 (LRU) and ~67 (window 1) to ~29 at window 2; 3 and 4 gain nothing
# more. Prefixes used more recently than the window stay cached.
RUN_WINDOW = 2


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
    """Doubly linked LRU list of free blocks with sentinels; O(1) popleft, append and remove.

    `members[block_id]` is 1 while the block is queued: the free set by id, which
    `allocate_runs` reads as one array instead of walking the list.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        blocks = list(blocks)
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        self.members = bytearray(max((b.block_id for b in blocks), default=-1) + 1)
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
        self.members[block.block_id] = 0
        self.num_free -= 1

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.members[block.block_id] = 1
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
        # hashed[block_id] is 1 while the block holds a cached hash (mirrors block_hash).
        self.hashed = bytearray(num_blocks)
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
                self._evict(block, evicted, offered)
            block.ref_cnt = 1
            out.append(block.block_id)
        self._announce_evictions(evicted, offered)
        return out

    def allocate_runs(self, n: int, window: int = RUN_WINDOW) -> list[int]:
        """Take `n` blocks for one end of a KV transfer, in as few runs of consecutive ids as
        the free blocks allow (each run ascending, runs by id); returns their ids.

        A single run of free blocks without a cached hash is taken first (it evicts nothing).
        Otherwise the candidates are those blocks plus the `window * n` at the LRU head: only
        prefixes among the window's least recently used free blocks can be evicted (window 1:
        a subset of what `allocate(n)` evicts). O(num_blocks) in numpy, so meant for one call
        per transfer or prefill chunk, not the per-token decode path. The caller checked
        there is space.
        """
        queue = self.free_queue
        if n > queue.num_free:
            raise ValueError(f"asked for {n} blocks, {queue.num_free} free")
        if n == 0:
            return []
        candidates = np.frombuffer(queue.members, dtype=np.bool_) & ~np.frombuffer(
            self.hashed, dtype=np.bool_
        )
        out = single_run(candidates, n)
        if out is None:
            for block in islice(queue, window * n):
                candidates[block.block_id] = True
            out = pick_runs(candidates, n)
        evicted: list[BlockHash] = []
        offered: list[tuple[BlockHash, int]] = []
        blocks = self.blocks
        for block_id in out:
            block = blocks[block_id]
            queue.remove(block)
            if block.block_hash is not None:
                self._evict(block, evicted, offered)
            block.ref_cnt = 1
        self._announce_evictions(evicted, offered)
        return out

    def _evict(
        self, block: Block, evicted: list[BlockHash], offered: list[tuple[BlockHash, int]]
    ) -> None:
        """Forget a free block's cached hash as the block is taken for new content."""
        evicted.append(block.block_hash)
        offered.append((block.block_hash, block.block_id))
        del self.cached[block.block_hash]
        block.block_hash = None
        self.hashed[block.block_id] = 0
        self.num_cached_free -= 1

    def _announce_evictions(
        self, evicted: list[BlockHash], offered: list[tuple[BlockHash, int]]
    ) -> None:
        if evicted and self.listener is not None:
            self.listener(BlockRemoved(evicted))
        if offered and self.on_evict is not None:
            self.on_evict(offered)

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
        lora: tuple[str, int] | None = None,
    ) -> None:
        """Register full, computed blocks under their hashes (one hash per block); `lora`:
        the (name, id) of the adapter they were computed for, which their event carries.

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
                self.hashed[block_id] = 1
        if self.listener is not None:
            name, lora_id = lora if lora is not None else (None, None)
            self.listener(
                BlockStored(list(hashes), parent, token_ids, block_size, None, name, lora_id)
            )

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash; returns how many were dropped. Blocks in use stay allocated."""
        n = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self.hashed[:] = bytes(self.num_blocks)
        self.num_cached_free = 0
        if self.listener is not None:
            self.listener(AllBlocksCleared())
        return n


def candidate_runs(candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the maximal runs of set entries in a bool array, by position."""
    padded = np.concatenate(([False], candidates, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return edges[0::2], edges[1::2] - edges[0::2]


def single_run(candidates: np.ndarray, n: int) -> list[int] | None:
    """The first `n` ids of the shortest candidate run that holds n (best fit: long runs
    stay for long transfers), or None if no run does."""
    starts, lengths = candidate_runs(candidates)
    fits = np.flatnonzero(lengths >= n)
    if not len(fits):
        return None
    start = int(starts[fits[np.argmin(lengths[fits])]])
    return list(range(start, start + n))


def pick_runs(candidates: np.ndarray, n: int) -> list[int]:
    """Ids of `n` of the candidate blocks (a bool array by id, at least n set) in as few runs
    of consecutive ids as possible: one run if one holds n (`single_run`), else the longest
    runs first, the last one cut short. Each run is ascending and the runs are by id."""
    one = single_run(candidates, n)
    if one is not None:
        return one
    starts, lengths = candidate_runs(candidates)
    taken: list[tuple[int, int]] = []
    left = n
    for i in np.argsort(-lengths, kind="stable"):
        take = min(int(lengths[i]), left)
        taken.append((int(starts[i]), take))
        left -= take
        if not left:
            break
    return [block_id for start, take in sorted(taken) for block_id in range(start, start + take)]


def mirror_runs(ids: list[int], source: Sequence[int]) -> list[int]:
    """Lay `ids` (the blocks allocate_runs took, ascending) over a transfer's positions so that
    each run of `source` block ids going up or down by one lands on ids going the same way: a
    READ is then one region per run and plane (kv_transfer.layout.block_runs) where the
    source's runs fit in ours. Longest source runs first, each into the shortest of our runs
    that holds it (best fit), cut over our longest run where none does. Positions past the
    source count as one more run."""
    positions: list[tuple[int, int, int]] = []  # (-length, first position, step)
    first = 0
    for length, step in source_runs(source[: len(ids)]):
        positions.append((-length, first, step))
        first += length
    if first < len(ids):
        positions.append((first - len(ids), first, 1))
    heapq.heapify(positions)
    free = sorted((length, start) for start, length in id_runs(ids))  # (room, first id)
    out = [0] * len(ids)
    while positions:
        neg_length, first, step = heapq.heappop(positions)
        length = -neg_length
        i = bisect.bisect_left(free, (length, -1))
        room, start = free.pop(i) if i < len(free) else free.pop()
        take = min(room, length)
        chunk = range(start, start + take)
        out[first : first + take] = chunk if step == 1 else reversed(chunk)
        if room > take:
            bisect.insort(free, (room - take, start + take))
        if length > take:
            heapq.heappush(positions, (take - length, first + take, step))
    return out


def id_runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first id, length) of the runs of ascending ids going up by one."""
    runs: list[list[int]] = []
    for block_id in ids:
        if runs and block_id == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([block_id, 1])
    return [(start, length) for start, length in runs]


def source_runs(source: Sequence[int]) -> list[tuple[int, int]]:
    """(length, step) of the maximal runs of ids moving by step = +1 or -1 (+1 if alone)."""
    runs: list[list[int]] = []
    for prev, block_id in zip((None, *source), source, strict=False):
        moved = block_id - prev if prev is not None else 0
        if runs and moved in (1, -1) and (runs[-1][0] == 1 or moved == runs[-1][1]):
            runs[-1][0] += 1
            runs[-1][1] = moved
        else:
            runs.append([1, 1])
    return [(length, step) for length, step in runs]
