"""Tensor-parallel model pieces: which slice of each weight a rank holds (`TPLayout`, pure
arithmetic shared by the model and the loader) and the vocab-parallel embedding (the
row-parallel linear and the vocab-parallel LM head are in model/linear.py).

Megatron's split, as vLLM does it: q/k/v and gate/up are column-parallel (each rank computes
its heads and its slice of the MLP), o_proj and down_proj are row-parallel (partial sums, one
all-reduce each, bias added once after it). KV heads are split across ranks, or replicated
when there are fewer KV heads than ranks (each rank then holds the one its q heads read). The
vocabulary is split in equal slices (the last padded with zero rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagefleet.engine.model.config import ModelConfig


class Collectives(Protocol):
    """What the parallel layers need from the rank group (see distributed/group.py)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None: ...


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

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> TPLayout:
        check_divisible(cfg, size)
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
        )

    @property
    def vocab_end(self) -> int:
        return min(self.vocab_start + self.vocab_per_rank, self.vocab_size)


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse a tensor-parallel size the model's shapes do not split into (vLLM's rules)."""
    rules = [
        (cfg.num_heads % size == 0, f"attention heads ({cfg.num_heads})"),
        (cfg.intermediate_size % size == 0, f"intermediate_size ({cfg.intermediate_size})"),
    ]
    kv = cfg.num_kv_heads
    if not (kv % size == 0 or size % kv == 0):
        rules.append((False, f"KV heads ({kv}), nor divide it"))
    for ok, what in rules:
        if not ok:
            raise ValueError(
                f"--tensor-parallel-size {size} does not divide the model's {what}; choose a "
                "size that does"
            )


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
