"""One step's sampling with drafts: the runner's rows (k + 1 per verifying request, one per
other request) become each request's emitted tokens and their logprobs (the target's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefleet.engine.outputs import TokenLogprobs
from pagefleet.engine.request import Request
from pagefleet.engine.sampler import Sampler, sampling_probs, top_logprobs
from pagefleet.engine.spec_decode.draft import DraftModelProposer
from pagefleet.engine.spec_decode.ngram import NgramProposer
from pagefleet.engine.spec_decode.rejection import greedy_accept, rejection_sample
from pagefleet.engine.spec_decode.stats import SpecDecodeCounters


@dataclass
class StepTokens:
    """Per sampled request, in batch order: its emitted tokens and their logprobs."""

    requests: list[Request]
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]


def proposals_useful(req: Request) -> bool:
    """Whether `req` speculates (see the package docstring's opt-out list)."""
    params = req.sampling_params
    return (
        not params.needs_penalties
        and req.num_output_tokens >= params.min_tokens
        and not req.hold_blocks
    )


def propose(
    proposer: NgramProposer | DraftModelProposer, requests: list[Request], enabled: bool = True
) -> None:
    """Set the drafts of the decoding `requests` for their next step (none for the others;
    none at all when not `enabled`)."""
    chosen: list[Request] = []
    rooms: list[int] = []
    for req in requests:
        # Room for the drafts and the token the target adds after them.
        room = req.max_len - req.num_tokens - 1
        decoding = req.num_computed_tokens == req.num_tokens - 1
        req.spec_token_ids = []
        if enabled and decoding and room > 0 and not req.status.finished and proposals_useful(req):
            chosen.append(req)
            rooms.append(room)
    if isinstance(proposer, NgramProposer):
        pairs = zip(chosen, rooms, strict=True)
        drafts = [proposer.propose(r.all_token_ids, room) for r, room in pairs]
    else:  # one batched forward per draft position
        drafts = proposer.propose_batch(chosen, rooms)
    for req, req_drafts in zip(chosen, drafts, strict=True):
        req.spec_token_ids = req_drafts


def sample_with_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    row_requests: list[Request],
    drafts: dict[str, list[int]],
    counters: SpecDecodeCounters,
) -> StepTokens:
    """Sample every request of the step: rows of a request with drafts are consecutive
    (k + 1 of them), other requests have one row. Greedy rows and rows without drafts go
    through the sampler as usual; random rows with drafts through the rejection sampler."""
    groups = _row_groups(row_requests, drafts)
    plain = [
        r
        for req, first, num in groups
        if not _random_drafts(req, drafts)
        for r in range(first, first + num)
    ]
    sampled = sampler.sample(logits[plain], [row_requests[r] for r in plain]) if plain else None
    plain_at = {row: i for i, row in enumerate(plain)}
    out = StepTokens([], [], [])
    for req, first, num in groups:
        req_drafts = drafts.get(req.request_id, []) if num > 1 else []
        if first in plain_at:
            at = plain_at[first]
            targets = sampled.token_ids[at : at + num]
            tokens = greedy_accept(targets, req_drafts) if req_drafts else targets
            logprobs = sampled.logprobs[at : at + len(tokens)]
        else:
            rows = logits[first : first + num].float()
            probs = sampling_probs(rows, [req.sampling_params] * num)
            probs = probs / probs.sum(dim=-1, keepdim=True)
            tokens = rejection_sample(probs, req_drafts, sampler.generator_for(req))
            logprobs = _target_logprobs(rows, tokens, req.sampling_params.logprobs)
        if req_drafts:
            counters.count(len(req_drafts), len(tokens) - 1)
        out.requests.append(req)
        out.token_ids.append(tokens)
        out.logprobs.append(logprobs)
    return out


def _random_drafts(req: Request, drafts: dict[str, list[int]]) -> bool:
    return not req.sampling_params.greedy and bool(drafts.get(req.request_id))


def _row_groups(
    row_requests: list[Request], drafts: dict[str, list[int]]
) -> list[tuple[Request, int, int]]:
    """(request, first row, rows) per sampled request, in batch order."""
    groups = []
    row = 0
    while row < len(row_requests):
        req = row_requests[row]
        num = 1 + len(drafts.get(req.request_id, ()))
        groups.append((req, row, num))
        row += num
    return groups


def _target_logprobs(
    rows: torch.Tensor, tokens: list[int], k: int | None
) -> list[TokenLogprobs | None]:
    if k is None:
        return [None] * len(tokens)
    logprobs = torch.log_softmax(rows, dim=-1)
    return [top_logprobs(logprobs[i], t, k) for i, t in enumerate(tokens)]
