"""The router's prefix index: which pod holds which block hashes (pure; the caller passes time).

`precise`: built from each pod's KV events (BlockStored / BlockRemoved / AllBlocksCleared).
Blocks in a pod's CPU offload tier (events with medium CPU) are indexed apart and count
HOST_TIER_WEIGHT of a device block in a match: a hit there is a copy back, not free.
`approximate`: built from what the router itself sent where, an LRU per pod sized from the
pod's `num_gpu_blocks`. In both modes a routing decision records its blocks at once
(speculatively, with a TTL, in precise mode), so a burst of identical prompts does not all
land on one pod before its events or next scrape arrive.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pagefleet.common.block_hash import BlockHash
from pagefleet.common.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

MODES = ("precise", "approximate")
# What a block in a pod's host tier is worth against one in its device pool: loading it back
# costs a host-to-device copy (cheaper than recomputing, dearer than a device hit).
HOST_TIER_WEIGHT = 0.5
# Host-tier blocks indexed per pod at most (a tier's size is not announced; a pod sending
# ever new ones must not grow the router without bound).
HOST_TIER_CAPACITY = 1 << 18
_NOBODY: frozenset[str] = frozenset()


class PrefixIndex:
    def __init__(
        self,
        mode: str = "precise",
        speculative_ttl: float = 2.0,
        default_capacity: int = 16384,
        host_capacity: int = HOST_TIER_CAPACITY,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"prefix index mode {mode!r}: one of {MODES}")
        self.mode = mode
        self.speculative_ttl = speculative_ttl
        self.default_capacity = default_capacity
        self._holders: dict[BlockHash, set[str]] = {}
        self._blocks: dict[str, OrderedDict[BlockHash, None]] = {}
        self._capacity: dict[str, int] = {}
        self._speculative: dict[BlockHash, dict[str, float]] = {}
        # Each pod's CPU offload tier, its newest blocks last (at most host_capacity a pod).
        self._host_blocks: dict[str, OrderedDict[BlockHash, None]] = {}
        self.host_capacity = host_capacity
        # KV-event subscriber threads update it while the event loop reads it.
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ updates

    def apply(self, pod: str, events: Iterable[KVEvent]) -> None:
        """Precise mode: fold a pod's KV events into the index."""
        with self._lock:
            self._apply(pod, events)

    def _apply(self, pod: str, events: Iterable[KVEvent]) -> None:
        for event in events:
            medium = getattr(event, "medium", None)
            if medium == MEDIUM_CPU:
                self._apply_host(pod, event)
            elif medium not in (None, MEDIUM_GPU):
                continue  # a medium this index does not score (a disk tier, a bad value)
            elif isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self._add(pod, h)
                    self._unspeculate(pod, h)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._remove(pod, h)
            elif isinstance(event, AllBlocksCleared):
                self._clear_blocks(pod)
                self._host_blocks.pop(pod, None)

    def _apply_host(self, pod: str, event: BlockStored | BlockRemoved) -> None:
        held = self._host_blocks.setdefault(pod, OrderedDict())
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                held[h] = None
                held.move_to_end(h)
            while len(held) > self.host_capacity:  # the oldest go first, as the tier's LRU
                del held[next(iter(held))]
        else:
            for h in event.block_hashes:
                held.pop(h, None)

    def record(self, pod: str, hashes: Sequence[BlockHash], now: float) -> list[BlockHash]:
        """A request with these blocks was just sent to `pod`; returns the hashes this added
        (for `unrecord` if the pod then fails)."""
        with self._lock:
            if self.mode == "approximate":
                held = self._blocks.get(pod, {})
                added = [h for h in hashes if h not in held]
                for h in hashes:
                    self._add(pod, h)
                self._evict_over_capacity(pod)
                return added
            expiry = now + self.speculative_ttl
            added = []
            for h in hashes:
                pods = self._speculative.setdefault(h, {})
                if pod not in pods:
                    added.append(h)
                pods[pod] = expiry
            return added

    def unrecord(self, pod: str, added: Sequence[BlockHash]) -> None:
        """Take back what `record` added: the request never reached the pod."""
        with self._lock:
            for h in added:
                if self.mode == "approximate":
                    self._remove(pod, h)
                else:
                    self._unspeculate(pod, h)

    def set_capacity(self, pod: str, num_blocks: int) -> None:
        with self._lock:
            self._capacity[pod] = max(num_blocks, 1)
            self._evict_over_capacity(pod)

    def remove_pod(self, pod: str) -> None:
        """Forget a pod (gone, restarted, reset): nothing of it may be predicted any more."""
        with self._lock:
            self._clear_blocks(pod)
            self._host_blocks.pop(pod, None)
            self._capacity.pop(pod, None)
            for h in [h for h, pods in self._speculative.items() if pod in pods]:
                self._unspeculate(pod, h)

    def expire(self, now: float) -> None:
        """Drop speculative entries past their TTL (call now and then)."""
        with self._lock:
            for h in list(self._speculative):
                pods = self._speculative[h]
                for pod in [p for p, expiry in pods.items() if expiry <= now]:
                    del pods[pod]
                if not pods:
                    del self._speculative[h]

    # ------------------------------------------------------------------ queries

    def match(self, hashes: Sequence[BlockHash], now: float) -> dict[str, float]:
        """Per pod, how many leading blocks of `hashes` it holds (pods with none are absent):
        device blocks count 1, the host-tier blocks that continue them HOST_TIER_WEIGHT."""
        with self._lock:
            found: dict[str, float] = dict(self._match(hashes, now))
            for pod, held in self._host_blocks.items():
                start = int(found.get(pod, 0))
                extra = _leading_run(hashes, start, held)
                if extra:
                    found[pod] = start + HOST_TIER_WEIGHT * extra
            return found

    def _match(self, hashes: Sequence[BlockHash], now: float) -> dict[str, int]:
        # The hot path of every decision (thousands of blocks for long prompts): the common
        # case, every remaining candidate holds the block, costs one lookup and a subset test.
        result: dict[str, int] = {}
        holders_of, speculative = self._holders, self._speculative
        candidates: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = holders_of.get(h, _NOBODY)
            if candidates is not None and candidates <= holders:
                continue
            spec = speculative.get(h)
            if spec:
                holders = holders | {p for p, expiry in spec.items() if expiry > now}
            if candidates is None:
                candidates = set(holders)
            else:
                for pod in candidates - holders:
                    result[pod] = i
                candidates &= holders
            if not candidates:
                return result
        for pod in candidates or ():
            result[pod] = len(hashes)
        return result

    def num_blocks(self, pod: str) -> int:
        return len(self._blocks.get(pod, ()))

    def pods(self) -> set[str]:
        return set(self._blocks) | {p for pods in self._speculative.values() for p in pods}

    # ------------------------------------------------------------------ internals

    def _add(self, pod: str, h: BlockHash) -> None:
        blocks = self._blocks.setdefault(pod, OrderedDict())
        if h in blocks:
            blocks.move_to_end(h)
            return
        blocks[h] = None
        self._holders.setdefault(h, set()).add(pod)

    def _remove(self, pod: str, h: BlockHash) -> None:
        blocks = self._blocks.get(pod)
        if blocks is None or h not in blocks:
            return
        del blocks[h]
        holders = self._holders[h]
        holders.discard(pod)
        if not holders:
            del self._holders[h]

    def _clear_blocks(self, pod: str) -> None:
        for h in list(self._blocks.get(pod, ())):
            self._remove(pod, h)
        self._blocks.pop(pod, None)

    def _unspeculate(self, pod: str, h: BlockHash) -> None:
        pods = self._speculative.get(h)
        if pods is not None:
            pods.pop(pod, None)
            if not pods:
                del self._speculative[h]

    def _evict_over_capacity(self, pod: str) -> None:
        blocks = self._blocks.get(pod)
        if blocks is None:
            return
        capacity = self._capacity.get(pod, self.default_capacity)
        while len(blocks) > capacity:
            oldest = next(iter(blocks))
            self._remove(pod, oldest)


def _leading_run(
    hashes: Sequence[BlockHash], start: int, held: OrderedDict[BlockHash, None]
) -> int:
    """How many of `hashes` from `start` on are in `held`, without a gap."""
    n = 0
    while start + n < len(hashes) and hashes[start + n] in held:
        n += 1
    return n
