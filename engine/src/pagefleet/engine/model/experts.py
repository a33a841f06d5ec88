"""The experts of a mixture-of-experts layer, stacked, and their compute without per-token
Python: the (token, expert) pairs are sorted by expert once per layer per step, each active
expert runs one GEMM pair over its contiguous rows, and the rows go back to their tokens,
weighted by the router, in one scatter-add.

A rank holds an `ExpertShard` (model/parallel.py): every expert's column slice (tensor
parallel), or whole experts (expert parallel). `w13` stacks each expert's gate and up rows,
`w2` its down projection; on CPU in float32 each expert's two matrices are oneDNN-prepacked as
the dense linears are (model/packed.py). On CUDA the grouped GEMMs are one Triton launch each
(model/fused_moe.py), with no host synchronisation, so decode steps can be graph-captured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.model.config import MoESpec
from pagefleet.engine.model.packed import pack_weight, shard_linear
from pagefleet.engine.model.parallel import ExpertShard
from pagefleet.engine.model.weights import Slice, expert_loader, set_weight_loader

GATE_UP = ("gate", "up")


def count_per_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs routed to each expert: [num_experts] int64. On CUDA by a scatter-add, because
    bincount reads the largest id back to the host to size its output, which a captured CUDA
    graph cannot do."""
    flat = ids.reshape(-1)
    if flat.is_cuda:
        counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
        return counts.scatter_add_(0, flat, torch.ones_like(flat))
    return torch.bincount(flat, minlength=num_experts)


def sum_pairs(rows: torch.Tensor, pairs: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """Per token, the sum of its pairs' rows (`pairs[i]` = token x top_k + slot of `rows[i]`;
    pairs not given add nothing): [tokens, hidden]. Slots are summed in order, which `route`
    makes the experts' order, the order the reference adds them in. A copy to the pairs'
    places then a sum over slots, not index_add_: on a busy machine its OpenMP loop stalled
    ~1000x (5 ms for 64 rows on 2 threads vs 6 us on one), index_copy_ does not."""
    full = rows.new_zeros(tokens * top_k, rows.shape[1]).index_copy_(0, pairs, rows)
    return full.view(tokens, top_k, rows.shape[1]).sum(dim=1)


class FusedExperts(nn.Module):
    """This rank's experts: w13 [count, 2 x columns, hidden] and w2 [count, hidden, columns]."""

    def __init__(self, hidden: int, spec: MoESpec, shard: ExpertShard) -> None:
        super().__init__()
        self.shard = shard
        self.columns = cols = shard.columns
        self.w13 = nn.Parameter(torch.empty(shard.count, 2 * cols, hidden))
        self.w2 = nn.Parameter(torch.empty(shard.count, hidden, cols))
        full = spec.intermediate_size
        held = range(shard.first, shard.end)
        rows = Slice(0, shard.column_start, cols) if cols < full else None
        columns = Slice(1, shard.column_start, cols) if cols < full else None
        gate_up = expert_loader(
            held,
            dict.fromkeys(GATE_UP, cols),
            dict.fromkeys(GATE_UP, rows),
            dict.fromkeys(GATE_UP, full),
        )
        set_weight_loader(self, "w13", gate_up, [(e, p) for e in held for p in GATE_UP])
        down = expert_loader(held, {"down": hidden}, {"down": columns}, {"down": hidden})
        set_weight_loader(self, "w2", down, [(e, "down") for e in held])
        # After prepack(): each expert's oneDNN-packed matrices (the stacked ones released).
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's routed experts held here of router weight x expert(token):
        [tokens, hidden] (the other ranks' experts, or columns, add theirs in the combine).
        `counts` is the step's tokens per expert (all experts, from the router)."""
        if x.is_cuda:
            from pagefleet.engine.model.fused_moe import fused_experts

            return fused_experts(x, self.w13, self.w2, weights, ids, self.shard.first)
        return self._grouped(x, weights, ids, counts)

    def _grouped(self, x, weights, ids, counts) -> torch.Tensor:
        shard = self.shard
        top_k = ids.shape[1]
        per_expert = counts.tolist()
        before = sum(per_expert[: shard.first])
        held = per_expert[shard.first : shard.end]
        # Pairs (token x top_k + slot) sorted by expert id (stable: by token within an
        # expert); this rank's experts are one contiguous run of them.
        order = torch.argsort(ids.reshape(-1), stable=True)[before : before + sum(held)]
        ys = self.run_groups(x.index_select(0, order // top_k), held)
        ys.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1))
        return sum_pairs(ys, order, x.shape[0], top_k)

    def run_groups(self, xs: torch.Tensor, held: list[int]) -> torch.Tensor:
        """Each held expert over its rows of `xs` (rows grouped by expert, `held[i]` rows for
        the shard's i-th expert, in order): one GEMM pair per active expert."""
        ys = torch.empty_like(xs)
        at = 0
        for local, n in enumerate(held):
            if n:
                ys[at : at + n] = self.expert(local, xs[at : at + n])
                at += n
        return ys

    def expert(self, local: int, rows: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            w13, w2 = self.packed[local]
            h = shard_linear(rows, None, w13)
        else:
            w13, w2 = self.w13[local], self.w2[local]
            h = F.linear(rows, w13)
        act = F.silu(h[:, : self.columns]) * h[:, self.columns :]
        return shard_linear(act, None, w2) if self.packed is not None else F.linear(act, w2)

    def prepack(self) -> None:
        """Each expert's matrices in oneDNN's blocked layout (model/packed.py); the stacked
        parameters are released (the CPU path reads only the packed ones)."""
        self.packed = [
            (pack_weight(self.w13[e]), pack_weight(self.w2[e])) for e in range(self.shard.count)
        ]
        self.w13, self.w2 = None, None
