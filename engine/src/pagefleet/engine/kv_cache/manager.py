"""KV-cache manager: per-request block tables over the block pool, with automatic prefix caching,
and for hybrid models each sequence's recurrent-state slot beside its blocks (state_cache.py).

The scheduler calls it; it never calls the scheduler. All-or-nothing allocation means a step
that cannot get its blocks (and, at admission, its state slot) changes nothing, so the
scheduler can preempt and retry.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagefleet.common.block_hash import BlockHash
from pagefleet.common.kv_events import KVEventListener
from pagefleet.engine.kv_cache.block_pool import Block, BlockPool, mirror_runs
from pagefleet.engine.kv_cache.host_tier import HostTier, TierLoad
from pagefleet.engine.kv_cache.state_cache import StateCache, StateConfig, StateStep
from pagefleet.engine.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        listener: KVEventListener | None = None,
        num_host_blocks: int = 0,
        state: StateConfig | None = None,
    ) -> None:
        """`num_host_blocks`: the CPU offload tier's size (0: no tier). `state`: a hybrid
        model's state slots (None: the model keeps only KV)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, listener)
        self.state: StateCache | None = None
        if state is not None:
            if num_host_blocks:
                raise ValueError(
                    "--kv-offloading-size: the CPU offload tier keeps KV blocks, not a hybrid "
                    "model's linear-attention state; serve this model without it"
                )
            self.state = StateCache(state, block_size, enable_prefix_caching)
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
        """Fraction of the cache held by live requests (0..1): blocks, and for a hybrid model
        state slots weighted by their bytes; cached-but-free blocks and snapshots don't count."""
        if self.state is None:
            return self.pool.usage()
        used = self.num_blocks - self.pool.num_free_blocks + self.state.usage_blocks
        total = self.num_blocks + self.state.config.num_slots * self.state.config.slot_blocks
        return used / total

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
        return hits if self.state is None else self.state.usable_hits(request, hits)

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
        admits_state = self.state is not None and request.state_slot < 0
        if not hits:
            # The common decode case: the current last block has room.
            num_needed = request.num_computed_tokens + num_new_tokens
            if num_needed <= len(table) * bs and not admits_state:
                return True
            num_new_blocks = max((num_needed + bs - 1) // bs - len(table), 0)
            if admits_state and not self._admit_state(request, [], num_new_blocks):
                return False
            if num_new_blocks > self.pool.free_queue.num_free:
                return False
            table.extend(self._take(num_new_blocks, request, transfer_source))
            if admits_state:
                self._take_state(request, [], transfer_source)
            if hits is not None:  # admission without a hit still counts as a query
                self._count_query(request, 0)
                self._count_tier_lookup(request, 0, 0)
            return True

        assert not table, "prefix hits are only taken by a request without blocks"
        num_computed = self.num_computed_after_hit(request, hits)
        num_new_blocks = (num_computed + num_new_tokens + bs - 1) // bs - len(hits)
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        extra = max(num_new_blocks, 0) + num_revived
        if admits_state and not self._admit_state(request, hits, extra):
            return False
        if num_new_blocks > self.pool.free_queue.num_free - num_revived:
            return False
        self.pool.touch(hits)
        table.extend(b.block_id for b in hits)
        table.extend(self._take(max(num_new_blocks, 0), request, transfer_source))
        if admits_state:
            self._take_state(request, hits, transfer_source)
        request.num_cached_blocks = len(hits)
        request.num_cached_tokens = len(hits) * bs
        request.num_computed_tokens = num_computed
        self._count_query(request, request.num_cached_tokens)
        self._count_tier_lookup(request, len(hits), 0)
        return True

    def _admit_state(self, request: Request, hits: list[Block], num_blocks: int) -> bool:
        """Whether a hybrid request can be admitted: a state slot (two for a prefill pod's:
        the hand-off) and room for its transport blocks beside `num_blocks` others."""
        transport = self._transport_blocks(request)
        if num_blocks + transport > self.pool.free_queue.num_free:
            return False
        return self.state.can_admit(request, hits)

    def _transport_blocks(self, request: Request) -> int:
        """KV blocks a P/D request's state travels in (a prefill pod's, or a decode pod's)."""
        moves = request.hold_blocks or request.remote_source is not None
        return self.state.config.transfer_blocks if moves else 0

    def _take_state(
        self, request: Request, hits: list[Block], source: Sequence[int] | None
    ) -> None:
        self.state.admit(request, hits)
        n = self._transport_blocks(request)
        if source is not None:  # mirror the prefill pod's transport blocks, after the prompt's
            first = request.num_prompt_blocks
            ids = mirror_runs(self.pool.allocate_runs(n), source[first : first + n])
        else:
            ids = self.pool.allocate_runs(n) if n else []
        request.state_block_ids = ids

    def take_state_step(self, scheduled: list[tuple[Request, int]]) -> StateStep | None:
        """A hybrid model's slot moves and snapshots for the step that runs `scheduled`
        (None for a model without state)."""
        return None if self.state is None else self.state.step(scheduled)

    def state_step_done(self) -> None:
        """The step that carried take_state_step's moves ran (frees loaded transport blocks)."""
        if self.state is not None:
            self.pool.free(self.state.step_done())

    def state_arrived(self, request: Request, ok: bool) -> None:
        """A decode pod's pull ended: load the state that came with the blocks, or (failed)
        give its transport blocks back."""
        if self.state is not None:
            self.pool.free(self.state.remote_arrived(request, ok))

    def reserve_draft_states(self, request: Request, num_drafts: int) -> int:
        """Drafts a decoding request may verify: all of them for a model without state; for a
        hybrid, as many as spare slots can hold the state after each (rejected drafts are
        rolled back to one of them)."""
        if self.state is None:
            return num_drafts
        return self.state.reserve_drafts(request, num_drafts)

    def state_verified(self, request: Request, num_accepted: int) -> None:
        """A verification kept `num_accepted` drafts: the state rolls back to the last kept."""
        if self.state is not None:
            self.state.verified(request, num_accepted)

    def drop_state(self, request: Request) -> None:
        """Give back the request's state slot, keeping its blocks (handed over to a decode
        pod, or quarantined)."""
        if self.state is not None:
            self.state.drop(request)

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
        """Release the request's blocks (tail first) and state slot; cached blocks stay
        reusable until evicted."""
        self.pool.free(request.block_ids)
        request.block_ids.clear()
        request.num_cached_blocks = 0
        request.num_cached_tokens = 0
        if self.state is not None:
            self.pool.free(request.state_block_ids)
            request.state_block_ids = []
            self.state.drop(request)

    def reset_prefix_cache(self) -> int:
        """Drop every cached hash, the offload tier's and the state snapshots too (emits
        AllBlocksCleared); returns how many the device pool dropped."""
        if self.host_tier is not None:
            self.host_tier.clear()
        if self.state is not None:
            self.state.slots.clear_snapshots()
        return self.pool.reset_prefix_cache()
