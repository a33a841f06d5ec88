"""The per-step logits processing of structured outputs and `logit_bias`, applied to a step's
sampled rows before the sampler's penalties, temperature, top-k and top-p see them.

Rows are in batch order; a request verifying drafts owns 1 + len(drafts) consecutive rows (as
spec_decode/verifier.py lays them out), the others one.
"""

from __future__ import annotations

import numpy as np
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


@torch.inference_mode()  # the runner's logits are inference tensors: updated in place
def constrain_logits(
    logits: torch.Tensor, row_requests: list[Request], drafts: dict[str, list[int]] | None = None
) -> torch.Tensor:
    """`logits` with each row's logit_bias added and its grammar's disallowed tokens at -inf,
    in place (a step's logits belong to its sampling alone); float32 when anything applies."""
    groups = [
        g
        for g in row_groups(row_requests, drafts or {})
        if g[0].grammar is not None or g[0].sampling_params.logit_bias
    ]
    if not groups:
        return logits
    logits = logits.float() if logits.dtype != torch.float32 else logits  # sampled in fp32
    num_rows, vocab = logits.shape
    bitmask = None
    for req, first, req_drafts in groups:
        rows = logits[first : first + 1 + len(req_drafts)]  # a view: no advanced indexing
        if req.sampling_params.logit_bias:
            ids, values = bias_tensors(req, logits.device)
            rows.index_add_(1, ids, values.expand(rows.shape[0], -1))
        if req.grammar is not None:
            if bitmask is None:  # rows without a grammar keep every bit set
                bitmask = torch.full((num_rows, (vocab + 31) // 32), -1, dtype=torch.int32)
            req.grammar.fill_draft_rows(bitmask, first, req_drafts)
    if bitmask is not None:
        apply_bitmask(logits, bitmask)
    return logits


def bias_tensors(req: Request, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's logit_bias as (token ids, biases) on `device`: built once, at its first
    sampled step, and kept on the request (its bias never changes)."""
    if req.logit_bias is None or req.logit_bias[0].device != device:
        pairs = req.sampling_params.logit_bias
        ids = torch.tensor([t for t, _ in pairs], device=device)
        req.logit_bias = (ids, torch.tensor([b for _, b in pairs], device=device))
    return req.logit_bias


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed tokens' logits to -inf, in place. On CPU with numpy: single-threaded
    and a few passes over bytes (torch's ops of this size each wake its thread pool, which
    costs more than the work on a busy machine); on an accelerator, one masked_fill."""
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        masked = disallowed_np(bitmask.numpy(), vocab)
        np.copyto(logits.numpy(), -np.inf, where=masked)
    else:
        masked = torch.from_numpy(disallowed_np(bitmask.numpy(), vocab))
        logits.masked_fill_(masked.to(logits.device, non_blocking=True), float("-inf"))


def disallowed_np(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """int32 words (bit i of word w = token 32w + i, llguidance's layout) -> a bool
    [rows, vocab] array, True where the token is not allowed (little-endian bytes: byte k of
    a row covers tokens 8k..8k+7)."""
    inverted = np.invert(bitmask.view(np.uint8))
    bits = np.unpackbits(inverted, axis=1, bitorder="little")
    return bits[:, :vocab].view(np.bool_)
