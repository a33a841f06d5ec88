"""How the tokens of a mixture-of-experts layer meet experts spread over ranks
(--enable-expert-parallel), and back: vLLM's --all2all-backend choice.

Attention is tensor-parallel here, so after its all-reduce every rank already holds every
token of the step. Hence:

- `allgather_reducescatter` (the default, vLLM's name and default): the all-gather that
  dispatches tokens has nothing to do; each rank runs its own experts over the tokens routed
  to them, and the partial outputs are summed. The reduce-scatter that combines them, followed
  by the all-gather that gives every rank the whole batch for the next attention layer, is one
  all-reduce: the same single collective a tensor-parallel MoE layer pays.
- `alltoall`: each rank takes a slice of the tokens, sends each (token, expert) row to the rank
  holding that expert and gets the results back (four all-to-alls: counts, rows, expert ids,
  results), then an all-gather rebuilds the batch. It moves only routed rows, which pays when
  ranks hold different tokens (data-parallel attention, which pagefleet does not have); with
  tokens replicated it moves more and waits on more collectives (benchmarks/moe.py measures
  both; docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagefleet.engine.model.experts import FusedExperts, sum_pairs
from pagefleet.engine.model.parallel import expert_ranges


class ExpertCollectives(Protocol):
    """What the all-to-all dispatch needs from the rank group (distributed/group.py)."""

    rank: int
    size: int

    def all_to_all(
        self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...


class ReplicatedTokens:
    """Tokens are on every rank already: each rank's experts (or expert columns) give a
    partial sum, reduced by the MoE block with the rest of the layer's partials."""

    reduces = True

    def __call__(self, experts: FusedExperts, x, weights, ids, counts) -> torch.Tensor:
        return experts(x, weights, ids, counts)


class AllToAllDispatch:
    """Rank r serves tokens r*per..(r+1)*per-1 (per = ceil(tokens / ranks)): their rows go to
    the ranks holding their experts and come back; the result is the whole layer output."""

    reduces = False

    def __init__(self, group: ExpertCollectives, num_experts: int) -> None:
        self.group = group
        ranges = expert_ranges(num_experts, group.size)
        self.owners = [rank for rank, (_, n) in enumerate(ranges) for _ in range(n)]
        self._owner_of: torch.Tensor | None = None  # on the step's device, made on first use

    def __call__(self, experts: FusedExperts, x, weights, ids, counts) -> torch.Tensor:
        group = self.group
        tokens, top_k = ids.shape
        per = -(-tokens // group.size)
        lo, hi = min(group.rank * per, tokens), min((group.rank + 1) * per, tokens)
        mine = ids[lo:hi].reshape(-1)
        # Sorted by expert, hence by owner (ranks hold ascending ranges of experts).
        order = torch.argsort(mine, stable=True)
        sent_ids = mine.index_select(0, order)
        if self._owner_of is None:  # (the model is built on the meta device)
            self._owner_of = torch.tensor(self.owners, dtype=torch.int64, device=ids.device)
        owners = self._owner_of.index_select(0, sent_ids)
        send = torch.bincount(owners, minlength=group.size)
        ones = [1] * group.size
        send_n, recv_n = send.tolist(), group.all_to_all(send, ones, ones).tolist()
        rows = group.all_to_all(x[lo:hi].index_select(0, order // top_k), send_n, recv_n)
        got = group.all_to_all(sent_ids, send_n, recv_n)
        results = _run_received(experts, rows, got)
        back = group.all_to_all(results, recv_n, send_n)
        back.mul_(weights[lo:hi].reshape(-1).index_select(0, order).unsqueeze(1))
        out = x.new_zeros(per, x.shape[1])
        out[: hi - lo] = sum_pairs(back, order, hi - lo, top_k)
        return group.all_gather(out)[:tokens]


def _run_received(experts: FusedExperts, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows from every sender (each sender's grouped by expert), run grouped by expert, in
    the order they came."""
    shard = experts.shard
    regroup = torch.argsort(ids, stable=True)
    held = torch.bincount(ids - shard.first, minlength=shard.count).tolist()
    return torch.empty_like(rows).index_copy_(
        0, regroup, experts.run_groups(rows.index_select(0, regroup), held)
    )


def make_dispatch(group, num_experts: int, expert_parallel: bool, backend: str):
    """The dispatch a rank's MoE blocks use (replicated tokens without expert parallelism)."""
    if expert_parallel and backend == "alltoall":
        return AllToAllDispatch(group, num_experts)
    return ReplicatedTokens()
