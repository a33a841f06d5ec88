"""The batched LoRA delta of one step: every row runs with its request's adapter slot (or none),
computed as punica does in two halves over slot-stacked weights:

    shrink:  t[row] = A[slot(row)] x[row]          (width = parts x max rank columns)
    expand:  y[row] += B[slot(row)] t[row]

Weights are stacked once per layer: `a` is [slots * width, in] (slot s owns rows s*width..),
`b` is [out, slots * width] (slot s owns those columns); a fused layer's parts take `max_rank`
columns each, B's rows of part p meeting only part p's columns. A row-parallel layer
all-reduces `t` between the halves (its shards' partial shrinks sum first).

Two torch implementations: `segments` (one GEMM pair per adapter in the step, over the rows
gathered by index: the CPU path) and `gathered` (each row's weights gathered and multiplied
as a batched matrix-vector product: the reference the Triton kernels and the benchmark compare
with). benchmarks/multi_lora.py measures both on CPU (docs/benchmarks.md). Triton kernels on
GPU: triton_ops.py. Never a loop over requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRABatch:
    """A step's rows by adapter slot. `segments`: (slot, its rows, or None when one adapter
    has every row), for the slots that have rows; base-model rows are in none."""

    row_slots: torch.Tensor  # [rows] int64, -1 for base-model rows
    segments: list[tuple[int, torch.Tensor | None]]

    @property
    def slots(self) -> list[int]:
        return [slot for slot, _ in self.segments]

    @classmethod
    def build(cls, row_slots: list[int], device: torch.device) -> LoRABatch | None:
        """The batch for rows with these slots; None when no row has an adapter."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        if not by_slot:
            return None
        tensor = torch.tensor(row_slots, dtype=torch.int64, device=device)
        if len(by_slot) == 1 and len(next(iter(by_slot.values()))) == len(row_slots):
            return cls(tensor, [(next(iter(by_slot)), None)])
        segments = [
            (slot, torch.tensor(rows, dtype=torch.int64, device=device))
            for slot, rows in by_slot.items()
        ]
        return cls(tensor, segments)


class SegmentKernels:
    """Per adapter in the step: its rows gathered, one GEMM each half, scattered back."""

    name = "segments"

    @staticmethod
    def shrink(
        x: torch.Tensor, a: torch.Tensor, batch: LoRABatch, width: int, present: list[bool]
    ) -> torch.Tensor:
        if len(batch.segments) == 1 and batch.segments[0][1] is None:
            slot = batch.segments[0][0]
            return x @ a[slot * width : (slot + 1) * width].t()
        t = x.new_zeros(x.shape[0], width)
        for slot, rows in batch.segments:
            if present[slot]:
                a_slot = a[slot * width : (slot + 1) * width]
                t.index_copy_(0, rows, x.index_select(0, rows) @ a_slot.t())
        return t

    @staticmethod
    def expand(
        t: torch.Tensor,
        b: torch.Tensor,
        batch: LoRABatch,
        width: int,
        present: list[bool],
        y: torch.Tensor,
    ) -> None:
        for slot, rows in batch.segments:
            if not present[slot]:
                continue
            b_slot = b[:, slot * width : (slot + 1) * width]
            if rows is None:
                y.addmm_(t, b_slot.t())
            else:
                y.index_add_(0, rows, t.index_select(0, rows) @ b_slot.t())


class GatheredKernels:
    """Each row's own weights gathered, then batched matrix-vector products (bmm): no loop at
    all, at the cost of copying every row's weights."""

    name = "gathered"

    @staticmethod
    def shrink(
        x: torch.Tensor, a: torch.Tensor, batch: LoRABatch, width: int, present: list[bool]
    ) -> torch.Tensor:
        slots = batch.row_slots
        stacked = a.view(-1, width, a.shape[1])[slots.clamp(min=0)]  # [rows, width, in]
        t = torch.bmm(stacked, x.unsqueeze(2)).squeeze(2)
        return t * (slots >= 0).unsqueeze(1).to(t.dtype)

    @staticmethod
    def expand(
        t: torch.Tensor,
        b: torch.Tensor,
        batch: LoRABatch,
        width: int,
        present: list[bool],
        y: torch.Tensor,
    ) -> None:
        slots = batch.row_slots
        per_slot = b.view(b.shape[0], -1, width).transpose(0, 1)  # [slots, out, width]
        delta = torch.bmm(per_slot[slots.clamp(min=0)], t.unsqueeze(2)).squeeze(2)
        y.add_(delta * (slots >= 0).unsqueeze(1).to(delta.dtype))


KERNELS = {k.name: k for k in (SegmentKernels, GatheredKernels)}


def kernels_for(device: torch.device, name: str | None = None):
    """The kernels a device runs: Triton on CUDA, segment GEMMs on CPU (or `name`'s)."""
    if name is None:
        name = "triton" if device.type == "cuda" else "segments"
    if name == "triton":
        from pagefleet.engine.lora.triton_ops import TritonKernels

        return TritonKernels
    return KERNELS[name]
