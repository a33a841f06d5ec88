"""The CPU offload tier's book-keeping (pure; the runner moves the bytes): which block hashes
the host pool holds in which slot, its own LRU, and the copies the engine must make.

Blocks evicted from the device pool are stored here instead of being lost; a prefix lookup that
misses the device pool but hits here loads them back into fresh device blocks. Stores are made
before the step that evicted them runs (that step may overwrite the device block); loads run
in the background while other requests step, so the slots a load reads stay pinned until the
engine says it landed (`load_done`): no store can take a pinned slot, and a prefix-cache reset
leaves pinned slots to be freed when their loads end.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagefleet.common.block_hash import BlockHash
from pagefleet.common.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVEventListener


@dataclass
class TierLoad:
    """One request's blocks coming back from the tier: host slot -> device block pairs."""

    request_id: str
    copies: list[tuple[int, int]]  # (slot, block_id)


@dataclass
class TierStats:
    """Counters for metrics: blocks each way, lookups and hits in blocks."""

    stored_blocks: int = 0
    loaded_blocks: int = 0
    evicted_blocks: int = 0
    # Blocks looked up here after a device miss, and found: once per request, not again when
    # a preempted request resumes (loaded_blocks counts every copy).
    queried_blocks: int = 0
    hit_blocks: int = 0
    loads: int = 0  # requests whose prefix came back from here


class HostTier:
    def __init__(
        self, num_slots: int, block_size: int, listener: KVEventListener | None = None
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs >= 1 block, got {num_slots}")
        self.num_slots = num_slots
        self.block_size = block_size
        self.listener = listener
        self.slots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.pinned: dict[int, int] = {}  # slot -> loads in flight reading it
        self.orphans: set[int] = set()  # pinned slots a reset dropped: freed when unpinned
        self.stores: list[tuple[int, int]] = []  # (block_id, slot) to copy before the step
        self.pending: set[int] = set()  # the slots of `stores`
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self.slots)

    def lookup(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of `hashes` are held here."""
        n = 0
        for block_hash in hashes:
            if block_hash not in self.slots:
                break
            n += 1
        return n

    def store(self, evicted: list[tuple[BlockHash, int]]) -> None:
        """Device blocks (hash, block_id) being evicted: keep their contents here."""
        stored: list[BlockHash] = []
        removed: list[BlockHash] = []
        for block_hash, block_id in evicted:
            if block_hash in self.slots:  # loaded from here earlier: the copy is still good
                self.slots.move_to_end(block_hash)
                continue
            slot = self._take_slot(removed)
            if slot is None:
                break  # every slot is pinned by loads in flight or stored into this step
            self.slots[block_hash] = slot
            self.stores.append((block_id, slot))
            self.pending.add(slot)
            stored.append(block_hash)
        self.stats.stored_blocks += len(stored)
        self.stats.evicted_blocks += len(removed)
        if self.listener is not None:
            if removed:
                self.listener(BlockRemoved(removed, MEDIUM_CPU))
            if stored:
                self.listener(BlockStored(stored, None, [], self.block_size, MEDIUM_CPU))

    def _take_slot(self, removed: list[BlockHash]) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for block_hash, slot in self.slots.items():
            # Nor a slot this step already stores into: one copy per slot and step, and the
            # events stay in order (a block is never removed before it was announced).
            if slot not in self.pinned and slot not in self.pending:
                del self.slots[block_hash]
                removed.append(block_hash)
                return slot
        return None

    def pin(self, hashes: list[BlockHash]) -> list[int]:
        """The slots of held `hashes`, pinned for a load: the caller hands the load to the
        runner and calls `load_done` when it has landed."""
        slots = []
        for block_hash in hashes:
            slot = self.slots[block_hash]
            self.slots.move_to_end(block_hash)
            self.pinned[slot] = self.pinned.get(slot, 0) + 1
            slots.append(slot)
        self.stats.loaded_blocks += len(slots)
        self.stats.loads += 1
        return slots

    def load_done(self, load: TierLoad) -> None:
        """The load's copies landed (or were abandoned): unpin its slots."""
        for slot, _ in load.copies:
            left = self.pinned[slot] - 1
            if left:
                self.pinned[slot] = left
                continue
            del self.pinned[slot]
            if slot in self.orphans:  # dropped by a reset while the load ran
                self.orphans.discard(slot)
                self.free_slots.append(slot)

    def take_stores(self) -> list[tuple[int, int]]:
        """The (block_id, slot) copies to make before the step just scheduled runs."""
        stores, self.stores = self.stores, []
        self.pending.clear()
        return stores

    def clear(self) -> None:
        """Forget every held block (a prefix-cache reset; its AllBlocksCleared covers this).
        Slots that loads still read are freed when those loads end."""
        self.slots.clear()
        self.orphans = set(self.pinned)
        self.free_slots = [s for s in range(self.num_slots - 1, -1, -1) if s not in self.pinned]

    def count_lookup(self, queried: int, hit: int) -> None:
        self.stats.queried_blocks += queried
        self.stats.hit_blocks += hit
