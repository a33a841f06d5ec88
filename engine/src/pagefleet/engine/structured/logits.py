"""The per-step logits processing of structured outputs and `logit_bias`, applied to a step's
sampled rows before the sampler's penalties, temperature, top-k and top-p see them.

Rows are in batch order; a request verifying drafts owns 1 + len(drafts) consecutive rows (as
spec_decode/verifier.py lays them out), the others one.
"""

from __future__ import annotations

import torch

from pagefleet.engine.request import Request


def row_groups(row_requests: list[Request], drafts: dict[str, list[int]]):
    """(request, first row, its drafts) per sampled request."""
    row = 0
    while row < len(row_requests):
        req = row_requests[row]
        req_drafts = drafts.get(req.request_id, []) if drafts else []
        yield req, row, req_drafts
        row += 1 + len(req_drafts)


def constrain_logits(
    logits: torch.Tensor, row_requests: list[Request], drafts: dict[str, list[int]] | None = None
) -> torch.Tensor:
    """`logits` with each row's logit_bias added and its grammar's disallowed tokens at -inf
    (a new float tensor when anything applies; the same one otherwise)."""
    groups = [
        g
        for g in row_groups(row_requests, drafts or {})
        if g[0].grammar is not None or g[0].sampling_params.logit_bias
    ]
    if not groups:
        return logits
    logits = logits.float().clone()
    vocab = logits.shape[1]
    masked_rows: list[int] = []
    bitmask = None
    for req, first, req_drafts in groups:
        rows = slice(first, first + 1 + len(req_drafts))
        bias = req.sampling_params.logit_bias
        if bias:
            ids = torch.tensor([t for t, _ in bias], device=logits.device)
            values = torch.tensor([b for _, b in bias], device=logits.device)
            logits[rows, ids] += values
        if req.grammar is not None:
            if bitmask is None:
                bitmask = torch.zeros((logits.shape[0], (vocab + 31) // 32), dtype=torch.int32)
            req.grammar.fill_draft_rows(bitmask, first, req_drafts)
            masked_rows.extend(range(rows.start, rows.stop))
    if masked_rows:
        index = torch.tensor(masked_rows)
        allowed = unpack_bitmask(bitmask[index], vocab).to(logits.device)
        index = index.to(logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 words (bit i of word w = token 32w + i) -> a bool [rows, vocab] tensor."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
