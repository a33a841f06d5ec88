"""Verification of drafts against the target's rows: which drafts are kept, and the one token
the target adds after them (pure functions over tensors and token lists).

A request that verified k drafts has k + 1 target rows: row i predicts the token after the
last token and drafts 0..i-1, so row i judges draft i and row k gives the bonus token.
"""

from __future__ import annotations

import torch


def greedy_accept(target_tokens: list[int], drafts: list[int]) -> list[int]:
    """Greedy verification: the longest prefix of `drafts` the target's argmax agrees with,
    then the target's own token at the first disagreement (or its bonus token after all)."""
    emitted: list[int] = []
    for draft, target in zip(drafts, target_tokens, strict=False):
        emitted.append(target)
        if draft != target:
            return emitted
    emitted.append(target_tokens[len(drafts)])
    return emitted


def rejection_sample(
    probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None
) -> list[int]:
    """Leviathan et al.'s accept/reject for drafts with a point-mass proposal q (n-gram).

    `probs` [k + 1, vocab] is the target's distribution at each row after temperature and
    truncation. Draft i is kept with probability min(1, p_i(d) / q_i(d)) = p_i(d); at the first
    rejection a token is drawn from max(0, p_i - q_i) renormalised (p_i with d removed), after
    all k are kept the bonus is drawn from p_k. Each emitted token is then distributed as the
    target's own sample at its position.
    """
    k = len(drafts)
    uniforms = torch.rand(k, generator=generator, device=probs.device).tolist()
    accept = probs[torch.arange(k, device=probs.device), drafts].tolist() if k else []
    emitted: list[int] = []
    for i, draft in enumerate(drafts):
        if uniforms[i] < accept[i]:
            emitted.append(draft)
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        emitted.append(_draw(residual, generator))
        return emitted
    emitted.append(_draw(probs[k], generator))
    return emitted


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalised non-negative weights."""
    return int(torch.multinomial(weights, 1, generator=generator).item())
