"""KV-cache manager: per-request block tables over the block pool, with automatic prefix caching.

The scheduler calls it; it never calls the scheduler. All-or-nothing allocation means a step
that cannot get its blocks changes nothing, so the scheduler can preempt and retry.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagefleet.common.block_hash import BlockHash
from pagefleet.common.kv_events import KVEventListener
from pagefleet.engine.kv_cache.block_pool import Block, BlockPool, mirror_runs
from pagefleet.engine.kv_cache.host_tier import HostTier, TierLoad
from pagefleet.engine.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        listener: KVEventListener | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        """`num_host_blocks`: the CPU offload tier's size (0: no tier)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, listener)
        self.host_tier: HostTier | None = None
        if num_host_blocks and enable_prefix_caching:
            self.host_tier = HostTier(num_host_blocks, block_size, listener)
            self.pool.on_evict = self.host_tier.store
        # Prefix-cache accounting in tokens, as vLLM's prefix_cache_queries/hits counters.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (0..1); cached-but-free blocks don't count."""
        return self.pool.usage()

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding reusable prefixes (evicted only when space is needed)."""
        return self.pool.num_cached_free

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of the request's leading full blocks found in the cache."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        cached = self.pool.cached
        hits: list[Block] = []
        for block_hash in request.block_hashes:
            block = cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def find_host_prefix(self, request: Request, num_device_hits: int) -> list[BlockHash]:
        """Hashes of the blocks after the device hits that the offload tier holds."""
        tier = self.host_tier
        if tier is None or request.sampling_params.prompt_logprobs is not None:
            return []
        wanted = request.block_hashes[num_device_hits:]
        return wanted[: tier.lookup(wanted)]

    def start_tier_load(
        self, request: Request, hits: list[Block], host_hashes: list[BlockHash]
    ) -> TierLoad | None:
        """Admit a request whose cached prefix continues in the offload tier: take its device
        hits, allocate blocks for the tier's and name the copies into them (the request
        computes nothing until `finish_tier_load`). None, changing nothing, without room."""
        tier = self.host_tier
        assert tier is not None and host_hashes and not request.block_ids
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if len(host_hashes) > self.pool.free_queue.num_free - num_revived:
            return None
        self.pool.touch(hits)
        # Pinned before allocating: evictions the allocation stores must not take these slots.
        slots = tier.pin(host_hashes)
        new_blocks = self.pool.allocate(len(host_hashes))
        request.block_ids.extend(b.block_id for b in hits)
        request.block_ids.extend(new_blocks)
        bs = self.block_size
        request.num_cached_blocks = len(hits)  # the loaded ones are cached once they landed
        request.num_cached_tokens = (len(hits) + len(host_hashes)) * bs
        request.num_computed_tokens = len(hits) * bs
        self._count_query(request, len(hits) * bs)
        self._count_tier_lookup(request, len(hits), len(host_hashes))
        return TierLoad(request.request_id, list(zip(slots, new_blocks, strict=True)))

    def finish_tier_load(self, request: Request) -> None:
        """The request's blocks landed from the tier: they count as computed (a full hit still
        computes the last token, for its logits) and are cached for other requests."""
        request.num_computed_tokens = min(
            len(request.block_ids) * self.block_size, request.num_tokens - 1
        )
        self.cache_computed_blocks(request)

    def num_computed_after_hit(self, request: Request, hits: list[Block]) -> int:
        """Tokens a hit saves. A full hit still computes the last token, for its logits only."""
        return min(len(hits) * self.block_size, request.num_tokens - 1)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hits: list[Block] | None = None,
        transfer_source: Sequence[int] | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens; all or nothing.

        `hits` (from find_cached_prefix) is given once, when a request without blocks is
        admitted; the request then starts with those blocks computed.

        `transfer_source`: the new blocks are a KV transfer's destination (a P/D pull) and
        these are the source's block ids for the request's blocks (possibly empty if
        unknown). The new blocks then come in runs of consecutive ids (allocate_runs), laid
        out to mirror the source's runs, so a READ is one descriptor per run and plane.
        A request that holds its blocks for a decode pod (`hold_blocks`, the prefill side of
        P/D) takes its new blocks in runs too: they are the source the decode pod reads, and
        its READ can only merge where both sides run.
        """
        bs = self.block_size
        table = request.block_ids
        if not hits:
            # The common decode case: the current last block has room.
            num_needed = request.num_computed_tokens + num_new_tokens
            if num_needed <= len(table) * bs:
                return True
            num_new_blocks = (num_needed + bs - 1) // bs - len(table)
            if num_new_blocks > self.pool.free_queue.num_free:
                return False
            table.extend(self._take(num_new_blocks, request, transfer_source))
            if hits is not None:  # admission without a hit still counts as a query
                self._count_query(request, 0)
                self._count_tier_lookup(request, 0, 0)
            return True

        assert not table, "prefix hits are only taken by a request without blocks"
        num_computed = self.num_computed_after_hit(request, hits)
        num_new_blocks = (num_computed + num_new_tokens + bs - 1) // bs - len(hits)
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > self.pool.free_queue.num_free - num_revived:
            return False
        self.pool.touch(hits)
        table.extend(b.block_id for b in hits)
        table.extend(self._take(max(num_new_blocks, 0), request, transfer_source))
        request.num_cached_blocks = len(hits)
        request.num_cached_tokens = len(hits) * bs
        request.num_computed_tokens = num_computed
        self._count_query(request, request.num_cached_tokens)
        self._count_tier_lookup(request, len(hits), 0)
        return True

    def _take(self, n: int, request: Request, source: Sequence[int] | None) -> list[int]:
        """`n` new blocks for positions len(request.block_ids).. of the request's table."""
        if source is not None:
            first = len(request.block_ids)
            return mirror_runs(self.pool.allocate_runs(n), source[first : first + n])
        if request.hold_blocks:
            return self.pool.allocate_runs(n)
        return self.pool.allocate(n)

    def _count_tier_lookup(self, request: Request, num_device_hits: int, num_hits: int) -> None:
        """The tier looked up past the device hits; counted once per request, as
        `_count_query` (a resumption after preemption says nothing about sharing)."""
        if self.host_tier is not None and request.num_preemptions == 0:
            self.host_tier.count_lookup(len(request.block_hashes) - num_device_hits, num_hits)

    def _count_query(self, request: Request, num_hit_tokens: int) -> None:
        # Counted once per request: a resumption after preemption re-finds its own blocks,
        # which says nothing about how well prompts share a cache.
        if self.enable_prefix_caching and request.num_preemptions == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks for reuse by later requests."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = request.num_computed_tokens // bs
        start = request.num_cached_blocks
        if num_full <= start:
            return
        hashes = request.block_hashes
        lora = request.lora_request
        self.pool.cache_blocks(
            request.block_ids[start:num_full],
            hashes[start:num_full],
            hashes[start - 1] if start else None,
            request.all_token_ids[start * bs : num_full * bs],
            bs,
            (lora.lora_name, lora.lora_int_id) if lora is not None else None,
        )
        request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first); cached ones stay reusable until evicted."""
        self.pool.free(request.block_ids)
        request.block_ids.clear()
        request.num_cached_blocks = 0
        request.num_cached_tokens = 0

    def reset_prefix_cache(self) -> int:
        """Drop every cached hash, the offload tier's too (emits AllBlocksCleared); returns how
        many the device pool dropped."""
        if self.host_tier is not None:
            self.host_tier.clear()
        return self.pool.reset_prefix_cache()
