"""Work run by tests/test_moe_triton.py in a process with TRITON_INTERPRET=1 (set by
triton_interpret_cases.enable_interpreter before any kernel module is imported): the fused
Triton experts and the torch grouped path on the same routing; the test compares them."""

from __future__ import annotations

import torch


def routing(case: str, tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """Expert ids [tokens, top_k], each row distinct and ascending (as `route` gives them)."""
    g = torch.Generator().manual_seed(seed)
    if case == "same-experts":  # every token the same experts: the others idle
        return torch.arange(top_k).repeat(tokens, 1)
    scores = torch.rand(tokens, num_experts, generator=g)
    return scores.topk(top_k, dim=-1).indices.sort(dim=-1).values


def run(case: str, tokens: int, first: int, count: int, seed: int = 0):
    """(fused, reference) outputs of experts first..first+count-1 of 5 (hidden 32, 16
    columns each), top-2 routing."""
    from pagefleet.engine.model.config import MoESpec
    from pagefleet.engine.model.experts import FusedExperts
    from pagefleet.engine.model.fused_moe import fused_experts
    from pagefleet.engine.model.parallel import ExpertShard

    hidden, columns, num_experts, top_k = 32, 16, 5, 2
    g = torch.Generator().manual_seed(seed + 1)
    spec = MoESpec(num_experts, top_k, columns, True, (0,))
    experts = FusedExperts(hidden, spec, ExpertShard(first, count, 0, columns))
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=g) * 0.2)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=g) * 0.2)
    x = torch.randn(tokens, hidden, generator=g)
    ids = routing(case, tokens, num_experts, top_k, seed)
    weights = torch.rand(tokens, top_k, generator=g)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    with torch.no_grad():
        reference = experts(x, weights, ids, counts)  # CPU tensors: the torch grouped path
        fused = fused_experts(x, experts.w13, experts.w2, weights, ids, first)
    return fused, reference
