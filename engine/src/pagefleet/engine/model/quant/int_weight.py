"""A weight-only integer-quantized matrix in the engine's canonical form, whatever checkpoint
it came from (GPTQ, AWQ, compressed-tensors, GGUF), and its rearrangement into contiguous
groups for the kernels.

`w[n, k] = code[n, k] * scale[n, g] + offset[n, g]`, with `g = g_idx[k]` (act-order GPTQ) or
`k // group_size`. An integer zero point z is the offset `-z * scale`; a float minimum (GGUF
Q4_1, Q4_K) is the offset itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagefleet.engine.model.quant.packing import pack_codes, unpack_codes


@dataclass
class IntWeight:
    codes: torch.Tensor  # canonical packed codes, [out, in * bits / 8] uint8 (quant/packing.py)
    bits: int
    scales: torch.Tensor  # [out, groups] float32
    offsets: torch.Tensor  # [out, groups] float32
    group_size: int  # input columns per group (in_features for one group per row)
    in_features: int
    g_idx: torch.Tensor | None = None  # [in] group of each input column (act-order)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def group_index(self) -> torch.Tensor:
        """The group of every input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.codes.device) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix `[out, in]` (the tests' and the reference quantizer's oracle;
        no kernel calls it)."""
        codes = unpack_codes(self.codes, self.bits).float()
        groups = self.group_index()
        return codes * self.scales[:, groups] + self.offsets[:, groups]

    def contiguous_groups(self, sizes: tuple[int, ...]) -> GroupedInt:
        """The same matrix with every kernel group of `size` contiguous input columns sharing
        one (scale, offset) per row, `size` the largest of `sizes` that fits the groups. Without
        act-order the groups already are (split when larger than `size`); with it the columns
        are sorted by group, each group's run padded with zero columns to a multiple of
        `size`, and the kernel's input gathered through `index` (where `index == in_features`
        reads a zero column)."""
        if self.g_idx is None:
            size = _fitting(self.group_size, sizes, self.in_features)
            if size is not None:
                repeat = self.group_size // size
                return GroupedInt(
                    self.codes,
                    self.bits,
                    self.scales.repeat_interleave(repeat, dim=1).contiguous(),
                    self.offsets.repeat_interleave(repeat, dim=1).contiguous(),
                    size,
                    None,
                )
        device = self.codes.device
        groups = self.group_index().cpu()  # the rearrangement is worked out on the host
        order = torch.argsort(groups, stable=True)
        counts = torch.bincount(groups, minlength=self.scales.shape[1])
        # The largest size every group's run divides needs no padding (one rank's act-order
        # groups are whole); otherwise the smallest pads least.
        whole = [s for s in sizes if bool((counts % s == 0).all())]
        size = max(whole) if whole else min(sizes)
        padded = (counts + size - 1) // size * size
        index = torch.full((int(padded.sum()),), self.in_features, dtype=torch.long)
        starts = torch.cumsum(padded, 0) - padded
        first = torch.cumsum(counts, 0) - counts
        for g in torch.nonzero(counts).flatten().tolist():
            n, at = int(counts[g]), int(starts[g])
            index[at : at + n] = order[int(first[g]) : int(first[g]) + n]
        chunk_group = torch.repeat_interleave(torch.arange(len(counts)), padded // size)
        index, chunk_group = index.to(device), chunk_group.to(device)
        codes = unpack_codes(self.codes, self.bits)
        codes = F.pad(codes, (0, 1))[:, index]  # padding columns meet zero inputs
        return GroupedInt(
            pack_codes(codes, self.bits),
            self.bits,
            self.scales[:, chunk_group].contiguous(),
            self.offsets[:, chunk_group].contiguous(),
            size,
            index,
        )


def _fitting(group_size: int, sizes: tuple[int, ...], in_features: int) -> int | None:
    """The largest kernel group size dividing `group_size` (and the input width)."""
    for size in sorted(sizes, reverse=True):
        if group_size % size == 0 and in_features % size == 0:
            return size
    return None


@dataclass
class GroupedInt:
    """An `IntWeight` whose groups are runs of `group_size` input columns, the input gathered
    through `index` first where it is not None (see IntWeight.contiguous_groups)."""

    codes: torch.Tensor
    bits: int
    scales: torch.Tensor  # [out, in' / group_size]
    offsets: torch.Tensor
    group_size: int
    index: torch.Tensor | None

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.index is None:
            return x
        return F.pad(x, (0, 1))[..., self.index]
