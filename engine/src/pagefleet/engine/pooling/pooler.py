"""Pooling one step's hidden states into per-request vectors (pure torch, no engine state).

A step computes, for each scheduled request, `n` consecutive prompt rows starting at prompt
position `start` (a long prompt arrives in several chunks). LAST takes the prompt's last row,
CLS its first, MEAN sums every row (in float32) and divides by the prompt's length once the
last chunk is in; a chunk that does not finish its prompt leaves a partial (the running sum,
or the first row) in the request's `PoolState`. The step's work is a few batched ops whatever
the number of requests; only chunked prompts cost one op each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagefleet.engine.pooling.config import PoolerConfig


@dataclass
class PoolState:
    """A request's pooling in progress: what its earlier chunks left (None: nothing yet)."""

    prompt_len: int
    partial: torch.Tensor | None = None  # MEAN: the running float32 sum; CLS: the first row

    def restart(self) -> None:
        """Preempted: its prompt is computed again from the start."""
        self.partial = None


@dataclass(frozen=True)
class Segment:
    """One request's rows in a step: hidden[row : row + n] are prompt positions start.."""

    state: PoolState
    row: int
    n: int
    start: int

    @property
    def ends(self) -> bool:
        return self.start + self.n >= self.state.prompt_len


def pool_step(
    config: PoolerConfig, hidden: torch.Tensor, segments: list[Segment]
) -> list[torch.Tensor | None]:
    """Per segment, the request's pooled vector (float32, before normalisation) if this step
    finished its prompt, else None (its partial is kept in its state)."""
    if config.pooling_type == "LAST":
        ending = [i for i, s in enumerate(segments) if s.ends]
        rows = torch.tensor(
            [segments[i].row + segments[i].n - 1 for i in ending], dtype=torch.int64
        )
        return _scatter(len(segments), ending, hidden[rows.to(hidden.device)].float())
    if config.pooling_type == "CLS":
        return _cls(hidden, segments)
    return _mean(hidden, segments)


def _scatter(count: int, where: list[int], rows: torch.Tensor) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = [None] * count
    for i, vector in zip(where, rows, strict=True):
        out[i] = vector
    return out


def _cls(hidden: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor | None]:
    firsts = [i for i, s in enumerate(segments) if s.start == 0]
    rows = torch.tensor([segments[i].row for i in firsts], dtype=torch.int64).to(hidden.device)
    first = _scatter(len(segments), firsts, hidden[rows].float())
    out: list[torch.Tensor | None] = []
    for seg, vector in zip(segments, first, strict=True):
        if vector is not None and not seg.ends:
            seg.state.partial = vector.clone()  # kept past this step's hidden states
        out.append((vector if vector is not None else seg.state.partial) if seg.ends else None)
    return out


def _mean(hidden: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor | None]:
    owner = torch.empty(hidden.shape[0], dtype=torch.int64)
    for i, seg in enumerate(segments):
        owner[seg.row : seg.row + seg.n] = i
    sums = torch.zeros(len(segments), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, owner.to(hidden.device), hidden.float())
    out: list[torch.Tensor | None] = []
    for seg, chunk_sum in zip(segments, sums, strict=True):
        state = seg.state
        total = chunk_sum if state.partial is None else state.partial + chunk_sum
        if seg.ends:
            out.append(total / state.prompt_len)
        else:
            state.partial = total
            out.append(None)
    return out


def finish_vectors(
    vectors: list[torch.Tensor], dimensions: list[int | None], normalize: bool
) -> list[torch.Tensor]:
    """Finished requests' vectors as returned: truncated to their Matryoshka `dimensions`
    (None: whole), then L2-normalised if the model normalises; float32 on the CPU."""
    if not vectors:
        return []
    if all(d is None for d in dimensions):
        batch = torch.stack(vectors)
        if normalize:
            batch = F.normalize(batch, p=2, dim=-1)
        return list(batch.cpu())
    out = []
    for vector, dims in zip(vectors, dimensions, strict=True):
        vector = vector[:dims] if dims is not None else vector
        out.append((F.normalize(vector, p=2, dim=-1) if normalize else vector).cpu())
    return out
