"""Property tests: random workloads on tiny pools keep every promise the scheduler makes.

A shadow KV pool records, for every slot written, which exact token prefix produced it. Reads
through a block table must then see the request's own prefix, whether the block was computed
by the request, revived from the free list or shared through a prefix hit.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import check_invariants, make_scheduler
from pagefleet.engine.kv_cache import AllBlocksCleared, Block, BlockRemoved, BlockStored
from pagefleet.engine.request import Request, RequestStatus
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.simulated import run_step, stand_in_token

VOCAB = 5  # tiny, so prompts collide into shared blocks by chance too
EOS = 3


class ShadowKV:
    """What a model would have written into each slot: the identity of the prefix up to it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots: list[list[tuple | None]] = [[None] * block_size for _ in range(num_blocks)]

    def run(self, scheduled: list[tuple[Request, int]], blocks: list[Block]) -> None:
        """`blocks`: the pool's blocks, by id."""
        bs = self.bs
        # Reads first: everything already computed must hold this request's prefix.
        for req, _ in scheduled:
            for pos in range(req.num_computed_tokens):
                block_id = req.block_ids[pos // bs]
                assert self.slots[block_id][pos % bs] == tuple(req.all_token_ids[: pos + 1]), (
                    f"{req} reads a slot holding another prefix at position {pos}"
                )
        for req, n in scheduled:
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                block = blocks[req.block_ids[pos // bs]]
                ident = tuple(req.all_token_ids[: pos + 1])
                if pos < req.num_cached_tokens:
                    # A prefix hit: the keys/values are there and must not be rewritten.
                    assert self.slots[block.block_id][pos % bs] == ident
                    continue
                assert block.ref_cnt == 1, f"write into shared block {block}"
                assert block.block_hash is None, f"write into cached block {block}"
                self.slots[block.block_id][pos % bs] = ident


def reference_output(prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The request run alone, token by token, with the same stop rules."""
    tokens = list(prompt)
    out: list[int] = []
    stop = set(params.stop_token_ids) | ({EOS} if not params.ignore_eos else set())
    while True:
        tok = stand_in_token(tokens, VOCAB)
        tokens.append(tok)
        out.append(tok)
        if tok in stop and len(out) >= params.min_tokens:
            return out
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out


class EventIndex:
    """A router-side prefix index built only from KV events."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()

    def apply(self, event) -> None:
        if isinstance(event, BlockStored):
            self.hashes.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.hashes.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            self.hashes.clear()


@dataclass
class Spec:
    arrival: int
    group: int
    prefix_len: int
    suffix: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    abort_after: int | None


spec_strategy = st.builds(
    Spec,
    arrival=st.integers(0, 12),
    group=st.integers(0, 2),
    prefix_len=st.integers(0, 24),
    suffix=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=12),
    max_tokens=st.integers(1, 40),
    min_tokens=st.integers(0, 3),
    ignore_eos=st.booleans(),
    abort_after=st.none() | st.integers(0, 20),
)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    specs=st.lists(spec_strategy, min_size=1, max_size=16),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(3, 12) | st.integers(13, 80),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    max_partial=st.integers(1, 3),
    long_threshold=st.integers(0, 12),
    enable_prefix_caching=st.booleans(),
    chunked=st.booleans(),
    abort_mid_step=st.booleans(),
    seed_prefixes=st.lists(st.integers(0, VOCAB - 1), min_size=24, max_size=24),
)
def test_random_workloads(
    specs,
    block_size,
    num_blocks,
    max_num_seqs,
    budget,
    max_partial,
    long_threshold,
    enable_prefix_caching,
    chunked,
    abort_mid_step,
    seed_prefixes,
):
    max_model_len = 64
    if not chunked:  # whole prompts only: the budget must hold the longest
        budget, long_threshold = max(budget, max_model_len), 0
    index = EventIndex()
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        listener=index.apply,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=chunked,
        max_num_seqs=min(max_num_seqs, budget),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        max_num_partial_prefills=max_partial,
        long_prefill_token_threshold=long_threshold,
    )
    shadow = ShadowKV(num_blocks, block_size)
    prefixes = [seed_prefixes[g:] + seed_prefixes[:g] for g in range(3)]
    accepted: dict[str, tuple[Request, list[int], Spec]] = {}
    aborted: set[str] = set()
    step = 0
    arrivals = sorted(enumerate(specs), key=lambda e: e[1].arrival)
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0][1].arrival <= step:
            i, spec = arrivals.pop(0)
            prompt = prefixes[spec.group][: spec.prefix_len] + spec.suffix
            params = SamplingParams(
                max_tokens=spec.max_tokens,
                min_tokens=min(spec.min_tokens, spec.max_tokens),
                ignore_eos=spec.ignore_eos,
            )
            req = Request(f"r{i}", prompt, params, eos_token_id=EOS, block_size=block_size)
            try:
                sched.add_request(req)
            except ValueError:
                # Rejected only for a reason stated at add_request: empty, too long, too big.
                final = min(len(prompt) + spec.max_tokens, max_model_len)
                assert (
                    not prompt
                    or len(prompt) >= max_model_len
                    or -(-(final - 1) // block_size) > num_blocks
                )
                continue
            accepted[req.request_id] = (req, prompt, spec)
        due = [
            rid
            for rid, (_, _, spec) in accepted.items()
            if spec.abort_after is not None and step == spec.arrival + spec.abort_after
        ]
        if not abort_mid_step:
            aborted.update(rid for rid in due if sched.abort(rid) is not None)
        check_invariants(sched)
        out = sched.schedule()
        assert sum(n for _, n in out.scheduled) == out.num_tokens <= budget
        assert len(out.scheduled) <= max_num_seqs
        assert all(n >= 1 for _, n in out.scheduled)
        assert len({r.request_id for r, _ in out.scheduled}) == len(out.scheduled)
        check_invariants(sched)
        shadow.run(out.scheduled, sched.kv_cache.pool.blocks)
        if abort_mid_step:  # between the forward pass and update_from_output
            aborted.update(rid for rid in due if sched.abort(rid) is not None)
        run_step(sched, out, VOCAB)
        check_invariants(sched)
        # A router fed only the KV events knows exactly what the engine caches.
        assert index.hashes == set(sched.kv_cache.pool.cached)
        step += 1
        assert step < 5000, "the workload did not finish: a request starved or the loop stalled"

    pool = sched.kv_cache.pool
    assert pool.num_free_blocks == num_blocks, "blocks leaked"
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sched.kv_cache.usage == 0.0
    assert not sched.requests
    for rid, (req, prompt, _) in accepted.items():
        if rid in aborted:
            assert req.status is RequestStatus.FINISHED_ABORTED
            continue
        assert req.status.finished and req.status is not RequestStatus.FINISHED_ABORTED
        # Preemption, chunking and prefix hits never change what a request generates.
        assert req.output_token_ids == reference_output(prompt, req.sampling_params, max_model_len)
