"""Tensor-parallel model pieces: which slice of each weight a rank holds (`TPLayout`, pure
arithmetic shared by the model and the loader) and the vocab-parallel embedding (the
row-parallel linear and the vocab-parallel LM head are in model/linear.py).

Megatron's split, as vLLM does it: q/k/v and gate/up are column-parallel (each rank computes
its heads and its slice of the MLP), o_proj and down_proj are row-parallel (partial sums, one
all-reduce each, bias added once after it). KV heads are split across ranks, or replicated
when there are fewer KV heads than ranks (each rank then holds the one its q heads read). The
vocabulary is split in equal slices (the last padded with zero rows).

Experts of a mixture-of-experts layer are split either way (`ExpertShard`): by default each
rank holds a column slice of every expert (as the dense MLP), with --enable-expert-parallel
whole experts, in contiguous ranges (the first `num_experts % size` ranks hold one more, so an
expert count the size does not divide is handled, not refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagefleet.engine.model.config import ModelConfig, MoESpec


class Collectives(Protocol):
    """What the parallel layers need from the rank group (see distributed/group.py)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None: ...


@dataclass(frozen=True)
class ExpertShard:
    """The experts one rank holds: global ids first..first+count-1, and of each expert's
    intermediate columns column_start..column_start+columns-1."""

    first: int
    count: int
    column_start: int
    columns: int

    @classmethod
    def of(cls, spec: MoESpec, rank: int, size: int, expert_parallel: bool) -> ExpertShard:
        if not expert_parallel:
            columns = spec.intermediate_size // size
            return cls(0, spec.num_experts, rank * columns, columns)
        first, count = expert_ranges(spec.num_experts, size)[rank]
        return cls(first, count, 0, spec.intermediate_size)

    @property
    def end(self) -> int:
        return self.first + self.count


def expert_ranges(num_experts: int, size: int) -> list[tuple[int, int]]:
    """(first expert, count) of each rank under expert parallelism: contiguous ranges, the
    first `num_experts % size` ranks one expert more."""
    base, extra = divmod(num_experts, size)
    return [(r * base + min(r, extra), base + (r < extra)) for r in range(size)]


@dataclass(frozen=True)
class TPLayout:
    """One rank's share of a model: heads, MLP columns and vocabulary rows."""

    rank: int
    size: int
    num_heads: int  # q heads on this rank
    num_kv_heads: int  # kv heads on this rank (1 when replicated)
    first_kv_head: int  # checkpoint index of this rank's first kv head
    intermediate_size: int  # MLP columns on this rank
    vocab_per_rank: int  # rows of the embedding / LM head slice (padded)
    vocab_start: int
    vocab_size: int  # the checkpoint's, unpadded
    expert_parallel: bool = False  # whole experts per rank (else a slice of every expert)
    experts: ExpertShard | None = None  # a mixture-of-experts model's share on this rank

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int, expert_parallel: bool = False) -> TPLayout:
        check_divisible(cfg, size, expert_parallel)
        kv = cfg.num_kv_heads
        if kv >= size:
            kv_local, first_kv = kv // size, rank * (kv // size)
        else:  # replicated: ranks r*size/kv .. (r+1)*size/kv - 1 share kv head r
            kv_local, first_kv = 1, rank // (size // kv)
        per_rank = -(-cfg.vocab_size // size)
        return cls(
            rank=rank,
            size=size,
            num_heads=cfg.num_heads // size,
            num_kv_heads=kv_local,
            first_kv_head=first_kv,
            intermediate_size=cfg.intermediate_size // size,
            vocab_per_rank=per_rank,
            vocab_start=rank * per_rank,
            vocab_size=cfg.vocab_size,
            expert_parallel=expert_parallel,
            experts=ExpertShard.of(cfg.moe, rank, size, expert_parallel) if cfg.moe else None,
        )

    @property
    def vocab_end(self) -> int:
        return min(self.vocab_start + self.vocab_per_rank, self.vocab_size)


def check_divisible(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Refuse a tensor-parallel size the model's shapes do not split into (vLLM's rules)."""
    rules = [(n % size == 0, f"{what} ({n})") for what, n in cfg.split_sizes().items()]
    kv = cfg.num_kv_heads
    if not (kv % size == 0 or size % kv == 0):
        rules.append((False, f"KV heads ({kv}), nor divide it"))
    if cfg.moe is not None:
        rules += _expert_rules(cfg.moe, size, expert_parallel)
    for ok, what in rules:
        if not ok:
            raise ValueError(
                f"--tensor-parallel-size {size} does not divide the model's {what}; choose a "
                "size that does"
            )


def _expert_rules(moe: MoESpec, size: int, expert_parallel: bool) -> list[tuple[bool, str]]:
    shared = moe.shared_expert_intermediate_size
    rules = [(shared % size == 0, f"shared expert's intermediate size ({shared})")]
    if expert_parallel:
        # Uneven counts are fine (expert_ranges); a rank without any expert is not.
        if moe.num_experts < size:
            raise ValueError(
                f"--enable-expert-parallel over {size} ranks needs at least one expert per "
                f"rank; the model has {moe.num_experts} experts: use a smaller "
                "--tensor-parallel-size, or leave expert parallelism off"
            )
    else:
        inter = moe.intermediate_size
        rules.append(
            (
                inter % size == 0,
                f"expert intermediate size ({inter}) (--enable-expert-parallel places whole "
                "experts instead)",
            )
        )
    return rules


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids in its vocabulary slice, zeroes the rest; an all-reduce sums
    the one non-zero row per token."""

    def __init__(self, layout: TPLayout, hidden: int, group: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(layout.vocab_per_rank, hidden))
        self.start, self.end = layout.vocab_start, layout.vocab_end
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(rows)
