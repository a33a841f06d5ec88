"""Iteration-level scheduler: decides, each step, which requests compute how many tokens.

One `schedule()` is the work of one forward pass: running requests first (decodes and the
next chunks of unfinished prompts), then waiting requests admitted FCFS while the token
budget, sequence slots and free blocks allow. When a running request needs a block and none
is free, the most recently admitted running request is preempted by recompute.

Anti-thrash rule: a request resumed from preemption is protected from being chosen as a
victim until it has sampled a token again (its recompute and the step that samples), and in the
step after it resumed, unless every candidate is protected. Without it, two requests that each
nearly fill the pool evict each other over and over and neither finishes its recompute (a
recompute split into chunks needs several steps, so protecting a single step is not enough).
With it, every resumption samples a token before it can lose its blocks again, so every request
that fits the pool alone eventually finishes.

The sampling step counts: it computes the last recomputed position, which may need a new block.
Protecting only the chunks before it (`num_computed + 1 < num_tokens`) livelocked two requests
that each need the whole pool (block size 8, 3 blocks, budget 2, long_prefill_token_threshold
1): each reached its sampling step unprotected while the other, resumed later, was still
recomputing and protected, so it preempted itself and threw its recompute away, forever
(tests/test_scheduler_liveness.py keeps the case).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagefleet.engine.config import CacheConfig, SchedulerConfig
from pagefleet.engine.kv_cache.host_tier import TierLoad
from pagefleet.engine.kv_cache.manager import KVCacheManager
from pagefleet.engine.kv_cache.state_cache import StateStep
from pagefleet.engine.request import Request, RequestStatus
from pagefleet.engine.validation import RequestRules

_LOADING = frozenset({RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING_FOR_TIER_LOAD})


@dataclass
class SchedulerOutput:
    """The work of one forward pass."""

    # (request, number of tokens it computes this step), in batch order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    # Requests that lost their blocks this step (the runner drops any state it keeps for them).
    preempted: list[Request] = field(default_factory=list)
    # Requests admitted with blocks allocated whose prompt KV must now be pulled from a
    # prefill pod (the engine starts the transfers; they run while steps go on).
    kv_loads: list[Request] = field(default_factory=list)
    # Copies from the CPU offload tier for requests admitted this step: the engine makes
    # `tier_stores` (blocks this step evicted) first, then starts these in the background.
    tier_loads: list[TierLoad] = field(default_factory=list)
    tier_stores: list[tuple[int, int]] = field(default_factory=list)  # (block_id, slot)
    # Speculative decoding: request id -> the drafts it verifies this step (its scheduled
    # count is 1 + len(drafts): the last token, then the drafts; see spec_decode/).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Hybrid models: state-slot moves and snapshots the runner makes in this step.
    state: StateStep | None = None
    num_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.kv_loads and not self.tier_loads

    def samples(self) -> list[Request]:
        """The scheduled requests that sample a token in this step (their prompt is done
        after it), in batch order: the rows a runner returns logits for."""
        return [r for r, n in self.scheduled if r.num_computed_tokens + n >= len(r.all_token_ids)]


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, vocab_size: int | None = None
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.rules = RequestRules(
            config.max_model_len, kv_cache.block_size, kv_cache.num_blocks, vocab_size
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Disaggregation: decode-side requests pulling their prompt's KV, and prefill-side
        # finished requests whose blocks are held for a decode pod to read.
        self.loading: dict[str, Request] = {}
        self.held: dict[str, Request] = {}
        # Requests whose prefix is being copied back from the CPU offload tier.
        self.tier_loading: dict[str, Request] = {}
        # aborted pulls whose READ could not be cancelled: their blocks are never reused.
        self.quarantined: list[Request] = []
        self.step_id = 0
        self.num_preemptions = 0

    @classmethod
    def create(
        cls,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        listener=None,
        vocab_size: int | None = None,
    ) -> Scheduler:
        if cache_config.num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks must be set (>= 1) to build a scheduler")
        kv = KVCacheManager(
            cache_config.num_gpu_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            listener,
            cache_config.num_host_blocks,
            cache_config.state,
        )
        return cls(scheduler_config, kv, vocab_size)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValueError naming the limit and flag it breaks."""
        self.check_request(request)
        request.status = RequestStatus.WAITING
        request.max_len = min(request.max_len, self.config.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """Raise ValueError unless `request` can be queued (see validation.RequestRules)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.block_size != self.block_size:
            raise ValueError(
                f"request hashed with block_size={request.block_size}, "
                f"engine uses {self.block_size} (--block-size)"
            )
        if request.prefill_only:
            self.rules.check_prefill_only(request.all_token_ids)
        else:
            self.rules.check(request.all_token_ids, request.sampling_params)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request now and free its blocks; unknown or finished ids are ignored."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request from outside the step (abort, a stop string), freeing its blocks if
        it is queued here. One that is not (a sibling never admitted, or one that finished
        in the step whose last token turned out to end a stop string) only takes `status`:
        the scheduler is the one writer of a request's status."""
        if self.requests.get(request.request_id) is request:
            self.finish_request(request.request_id, status)
        else:
            request.status = status

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End the queued request `request_id` now and free its blocks; None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status in _LOADING:
            # A transfer or tier copy may still be writing its blocks: freed when it ends.
            request.status = status
            return request
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = status
        return request

    def finish_remote_load(self, request_id: str, ok: bool) -> Request | None:
        """A decode-side transfer ended. On success the prompt counts as computed except its
        last token (recomputed for its logits, as after a full prefix hit); on failure the
        request computes its prompt here (its blocks and local prefix hits are kept)."""
        req = self.loading.pop(request_id, None)
        if req is None:
            return None
        req.remote_source = None
        if req.status.finished:  # aborted while loading
            self.kv_cache.free(req)
            return req
        self.kv_cache.state_arrived(req, ok)
        if ok:
            req.num_computed_tokens = max(req.num_computed_tokens, req.num_tokens - 1)
            if self.kv_cache.enable_prefix_caching:
                self.kv_cache.cache_computed_blocks(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    def finish_tier_load(self, request_id: str) -> Request | None:
        """A request's blocks landed from the offload tier: it joins the running requests (one
        aborted meanwhile frees its blocks now, as no copy writes them any more)."""
        req = self.tier_loading.pop(request_id, None)
        if req is None:
            return None
        if req.status.finished:
            self.kv_cache.free(req)
            return req
        self.kv_cache.finish_tier_load(req)
        if req.num_preemptions:  # a resumption: protected from preemption (module docstring)
            self._resumed(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    def quarantine_remote_load(self, request_id: str) -> Request | None:
        """A transfer that could not be cancelled may still write the request's blocks: they
        are never freed (a deliberate leak, logged by the caller) and the request is aborted."""
        req = self.loading.pop(request_id, None)
        if req is None:
            return None
        self.requests.pop(request_id, None)
        req.status = RequestStatus.FINISHED_ABORTED
        self.kv_cache.drop_state(req)  # NIXL writes blocks, never state slots
        self.quarantined.append(req)
        return req

    def release_held(self, request_id: str) -> bool:
        """A decode pod has the blocks (or gave up, or the hold timed out): free them."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv_cache.free(req)
        return True

    @property
    def num_held_blocks(self) -> int:
        return sum(len(r.block_ids) + len(r.state_block_ids) for r in self.held.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.loading or self.tier_loading)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        self.step_id += 1
        out = SchedulerOutput()
        scheduled = out.scheduled
        budget = cfg.max_num_batched_tokens
        chunk_cap = cfg.long_prefill_token_threshold or budget
        num_partial = 0  # requests whose prompt will still be unfinished after this step

        running = self.running
        bs = self.block_size
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            n = len(req.all_token_ids) - computed
            if n > 1:
                n = min(n, budget, chunk_cap)
            elif req.spec_token_ids:
                # The drafts' slots (the lookahead) only from free blocks: guesses never cost
                # another request a preemption; without room the request decodes plainly.
                k = self._num_drafts(req, budget)
                if k and self.kv_cache.allocate_slots(req, 1 + k):
                    n += self.kv_cache.reserve_draft_states(req, k)
            # The inline test is the fast path: the last block has room (most decode steps).
            if computed + n > len(req.block_ids) * bs and not self._allocate_or_preempt(
                req, i, n, out
            ):
                break  # the request preempted itself: nothing later fits either
            if n > 1 and computed + 1 == len(req.all_token_ids):
                out.spec_token_ids[req.request_id] = req.spec_token_ids[: n - 1]
            if computed + n < len(req.all_token_ids):
                num_partial += 1
            scheduled.append((req, n))
            budget -= n
            i += 1

        # Requests beyond the budget wait for a later step, still holding their blocks.
        if not out.preempted:
            budget = self._admit(out, budget, chunk_cap, num_partial)
        out.num_tokens = cfg.max_num_batched_tokens - budget
        if scheduled:  # a step nothing runs in moves no state: its moves wait for one that does
            out.state = self.kv_cache.take_state_step(scheduled)
        tier = self.kv_cache.host_tier
        if tier is not None:
            out.tier_stores = tier.take_stores()
        return out

    @staticmethod
    def _num_drafts(req: Request, budget: int) -> int:
        """Drafts a decoding request verifies: each costs a token of the budget, and all of
        them plus the target's token must fit under max_len."""
        return max(0, min(len(req.spec_token_ids), budget - 1, req.max_len - req.num_tokens - 1))

    def _admit(self, out: SchedulerOutput, budget: int, chunk_cap: int, num_partial: int) -> int:
        cfg = self.config
        kv = self.kv_cache
        waiting = self.waiting
        # LoRA: admitted requests run at most max_loras distinct adapters; a request whose
        # adapter would be one too many waits, and those behind it may go (as vLLM skips).
        adapters = self._admitted_adapters() if cfg.max_loras else None
        skipped: list[Request] = []
        while waiting and budget > 0 and self._num_admitted() < cfg.max_num_seqs:
            req = waiting[0]
            if adapters is not None and req.lora_name is not None:
                if req.lora_name not in adapters and len(adapters) >= cfg.max_loras:
                    skipped.append(waiting.popleft())
                    continue
                adapters.add(req.lora_name)
            hits = kv.find_cached_prefix(req)
            # The tier is left out when the KV comes over the wire: the pull skips only
            # blocks the device pool holds.
            host = kv.find_host_prefix(req, len(hits)) if req.remote_source is None else []
            if host:
                load = kv.start_tier_load(req, hits, host)
                if load is None:
                    break
                self._park(req, RequestStatus.WAITING_FOR_TIER_LOAD, self.tier_loading)
                out.tier_loads.append(load)
                continue
            remaining = req.num_tokens - kv.num_computed_after_hit(req, hits)
            if req.remote_source is not None:
                # Blocks for the whole prompt now, no compute: the KV comes over the wire.
                # Run-aware blocks mirroring the source's, so the READ coalesces.
                source = req.remote_source.block_ids
                if not kv.allocate_slots(req, remaining, hits, transfer_source=source):
                    break
                self._park(req, RequestStatus.WAITING_FOR_REMOTE_KVS, self.loading)
                out.kv_loads.append(req)
                continue
            n = min(remaining, budget, chunk_cap)
            if n < remaining:
                if not cfg.enable_chunked_prefill or num_partial >= cfg.max_num_partial_prefills:
                    break
                num_partial += 1
            if not kv.allocate_slots(req, n, hits):
                break
            waiting.popleft()
            if req.status is RequestStatus.PREEMPTED:
                self._resumed(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
        waiting.extendleft(reversed(skipped))
        return budget

    def _admitted_adapters(self) -> set[str]:
        admitted = (*self.running, *self.loading.values(), *self.tier_loading.values())
        return {r.lora_name for r in admitted if r.lora_name is not None}

    def _park(self, req: Request, status: RequestStatus, parked: dict[str, Request]) -> None:
        """Admit the head of the queue with its blocks, computing nothing until its KV
        arrives (pulled from a prefill pod, or copied back from the offload tier)."""
        self.waiting.popleft()
        req.status = status
        parked[req.request_id] = req

    def _num_admitted(self) -> int:
        return len(self.running) + len(self.loading) + len(self.tier_loading)

    def _allocate_or_preempt(self, req: Request, i: int, n: int, out: SchedulerOutput) -> bool:
        """Preempt until `req` (at running[i]) gets its blocks; False if it was the victim."""
        while not self.kv_cache.allocate_slots(req, n):
            victim = self._pick_victim(i)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _pick_victim(self, current: int) -> Request:
        """The most recently admitted request not yet scheduled this step (or the current one),
        skipping protected ones (see the module docstring) unless nothing else is left."""
        running = self.running
        for j in range(len(running) - 1, current - 1, -1):
            if not self._protected(running[j]):
                return running[j]
        return running[-1]

    def _resumed(self, req: Request) -> None:
        req.resumed_step, req.resumed_len = self.step_id, len(req.all_token_ids)

    def _protected(self, req: Request) -> bool:
        if req.resumed_step < 0:
            return False
        # No token since it resumed: recomputing, or in the step that samples.
        not_sampled = len(req.all_token_ids) <= req.resumed_len
        return not_sampled or req.resumed_step >= self.step_id - 1

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_cache.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []  # a resumed request recomputes, then proposes again
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(
        self, out: SchedulerOutput, sampled_token_ids: list[int]
    ) -> list[Request]:
        """Apply one step's results; returns the requests that finished in it.

        `sampled_token_ids` holds one token per scheduled request that samples in this step
        (see `SchedulerOutput.samples`), in `out.scheduled` order; a request whose prompt is
        still unfinished after its chunk samples nothing. Extra tokens are ignored. A request
        that verified drafts (`out.spec_token_ids`) gets a list instead: the drafts accepted
        and the target's token; only those count as computed, a stop token or max_len cuts
        the list there, and its blocks past its tokens go back to the pool.
        """
        kv = self.kv_cache
        bs = self.block_size
        caching = kv.enable_prefix_caching
        running_status = RequestStatus.RUNNING
        finished: list[Request] = []
        next_token = 0
        for req, n in out.scheduled:
            computed = req.num_computed_tokens + n
            tokens = req.all_token_ids
            samples = computed >= len(tokens) and not req.prefill_only
            if samples:
                token = sampled_token_ids[next_token]
                next_token += 1
            if req.status is not running_status:
                continue  # aborted between schedule() and now
            if samples and isinstance(token, list):
                if self._append_verified(req, token):
                    finished.append(req)
                continue
            req.num_computed_tokens = computed
            if caching and computed // bs > req.num_cached_blocks:
                kv.cache_computed_blocks(req)
            if not samples:
                if req.prefill_only and computed >= len(tokens):  # pooled: done with its prompt
                    req.status = RequestStatus.FINISHED_STOPPED
                    finished.append(req)
                continue  # a prompt chunk: no token yet
            tokens.append(token)
            if self._append_ends(req, token):
                finished.append(req)
        if out.state is not None:
            kv.state_step_done()
        if finished:
            for req in finished:
                if req.hold_blocks:
                    self.held[req.request_id] = req
                    kv.drop_state(req)  # its state went into its transport blocks
                else:
                    kv.free(req)
                del self.requests[req.request_id]
            self.running = [r for r in self.running if r.status is running_status]
        return finished

    def _append_ends(self, req: Request, token: int) -> bool:
        """Account for `token`, just appended: hash a block it completed, and say whether it
        ends the request (a stop token once min_tokens are out, or max_len)."""
        num_tokens = len(req.all_token_ids)
        if num_tokens % self.block_size == 0:
            req.hash_last_block()
        if token in req.stop_ids and (
            num_tokens - req.num_prompt_tokens >= req.sampling_params.min_tokens
        ):
            req.status = RequestStatus.FINISHED_STOPPED
        elif num_tokens >= req.max_len:
            req.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        return True

    def _append_verified(self, req: Request, emitted: list[int]) -> bool:
        """Apply a verification's tokens (accepted drafts, then the target's): True if they
        ended the request. KV is valid for every input row whose token was kept, so all
        tokens but the new last one count as computed; blocks past them are given back."""
        ended = False
        start = req.num_computed_tokens
        for token in emitted:
            req.all_token_ids.append(token)
            if self._append_ends(req, token):
                ended = True
                break
        req.num_computed_tokens = len(req.all_token_ids) - 1
        kv = self.kv_cache
        kv.state_verified(req, req.num_computed_tokens - start - 1)
        if kv.enable_prefix_caching and req.num_computed_tokens // self.block_size > (
            req.num_cached_blocks
        ):
            kv.cache_computed_blocks(req)
        needed = -(-len(req.all_token_ids) // self.block_size)
        if not ended and len(req.block_ids) > needed:
            kv.pool.free(req.block_ids[needed:])
            del req.block_ids[needed:]
        return ended
