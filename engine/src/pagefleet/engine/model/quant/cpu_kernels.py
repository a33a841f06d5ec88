"""CPU matmuls on integer weight codes, never a dequantized weight: torch's packed kernels.

torch's `_weight_int4pack_mm_for_cpu` (tinygemm's layout: groups of 32-256 input columns,
`(q - 8) * scale + zero` per group and row) and `_weight_int8pack_mm` (int8, one scale per
row) are vectorised for bfloat16 inputs only: with float32 inputs they ran 20-40x slower than
oneDNN's float32 GEMM, with bfloat16 inputs 2-5x faster at decode sizes
(benchmarks/quantization.py, `--kernels`). So activations enter them as bfloat16, with the
scales, and the result returns in the model's dtype: a weight-only kernel's usual precision
(GPU W4A16 kernels compute in half precision too).

- 4-bit codes: tinygemm directly (act-order columns gathered into contiguous groups first);
  for steps of many rows, from the row count where they measured faster on this machine and
  shape (`--linear-path auto`; otherwise never), tiles of the weight dequantized to bfloat16
  and multiplied by torch's bfloat16 matmul (quant/int4_tiles.py): tinygemm's time grows with
  the rows.
- symmetric 8-bit codes, one group per row: int8pack.
- other 8-bit codes (groups, zero points): split into two 4-bit planes, `code = 16 * hi + lo`,
  each a tinygemm matmul on its own scales (`16 * scale`, `scale`): exact, and the same bytes
  as int8.
"""

from __future__ import annotations

import torch

from pagefleet.engine.model.quant.int4_tiles import Int4Tiles, choose_tile_rows
from pagefleet.engine.model.quant.int_weight import GroupedInt, IntWeight
from pagefleet.engine.model.quant.packing import unpack_codes

TINYGEMM_GROUPS = (32, 64, 128, 256)
TINYGEMM_ROWS = 16  # tinygemm's packing wants output rows in multiples of 16
KERNEL_DTYPE = torch.bfloat16


def _tinygemm_pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes `[out, in]` (0..15), out padded to a multiple of 16 -> tinygemm's layout."""
    rows = -(-codes.shape[0] // TINYGEMM_ROWS) * TINYGEMM_ROWS
    padded = torch.zeros(rows, codes.shape[1], dtype=torch.int32)
    padded[: codes.shape[0]] = codes
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded, 2)


def _scale_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """tinygemm's `[groups, out (padded), 2]` (scale, zero) in the kernel dtype."""
    rows = -(-scales.shape[0] // TINYGEMM_ROWS) * TINYGEMM_ROWS
    both = torch.zeros(scales.shape[1], rows, 2, dtype=torch.float32)
    both[:, : scales.shape[0], 0] = scales.t()
    both[:, : scales.shape[0], 1] = zeros.t()
    return both.to(KERNEL_DTYPE)


class TinyGemmPlane:
    """One tinygemm matmul: 4-bit codes with their (scale, zero) per group of `group_size`;
    steps of `tile_rows` rows and more on the tiles (None: never; set by the load's
    measurement, int4_tiles.choose_tile_rows, or by the caller)."""

    def __init__(self, codes: torch.Tensor, scales, zeros, group_size: int) -> None:
        self.out_features = codes.shape[0]
        self.packed = _tinygemm_pack(codes)
        self.scale_zeros = _scale_zeros(scales, zeros)
        self.group_size = group_size
        self.tiles = Int4Tiles.of(self.packed, self.scale_zeros, group_size)
        self.tile_rows: int | None = None

    def tinygemm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scale_zeros
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_rows is not None and x.shape[0] >= self.tile_rows:
            y = self.tiles(x)
        else:
            y = self.tinygemm(x)
        return y[:, : self.out_features]

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scale_zeros]


class CpuIntKernel:
    """y = x W^T for an `IntWeight`, on torch's packed CPU kernels (see the module docstring)."""

    def __init__(self, weight: IntWeight) -> None:
        self.out_features = weight.out_features
        self.grouped: GroupedInt | None = None
        self.int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.planes: list[TinyGemmPlane] = []
        symmetric = bool(torch.equal(weight.offsets, -128 * weight.scales))
        if weight.bits == 8 and weight.g_idx is None and weight.scales.shape[1] == 1 and symmetric:
            self._per_row_int8(weight)
            return
        g = weight.contiguous_groups(TINYGEMM_GROUPS)
        self.grouped = g
        codes = unpack_codes(g.codes, g.bits).to(torch.int32)
        # tinygemm computes (q - 8) * scale + zero; ours is q * scale + offset.
        if g.bits == 4:
            self.planes = [TinyGemmPlane(codes, g.scales, g.offsets + 8 * g.scales, g.group_size)]
        else:
            # code = 16 hi + lo: (hi - 8) 16 s + (lo - 8) s + (136 s + offset). The constant
            # is split over the two planes' zeros as bfloat16(c) + bfloat16(c - bfloat16(c)):
            # the second carries the first's rounding, so the sum keeps c to ~2^-16 of itself
            # (one zero of c would lose 2^-9 of it: a quarter step when c is 128 s).
            hi, lo = codes >> 4, codes & 15
            constant = g.offsets + 136 * g.scales
            head = constant.to(KERNEL_DTYPE).float()
            self.planes = [
                TinyGemmPlane(hi, 16 * g.scales, head, g.group_size),
                TinyGemmPlane(lo, g.scales, constant - head, g.group_size),
            ]
        g.codes = g.codes[:0]  # only the planes are kept

    def _per_row_int8(self, weight: IntWeight) -> None:
        """Symmetric codes (offset -128 s): int8pack on code - 128 as it is. (With zero
        points the rank-one correction would cancel a large part of int8pack's bfloat16
        output: those take the planes.)"""
        signed = (unpack_codes(weight.codes, 8).to(torch.int16) - 128).to(torch.int8)
        self.int8 = (signed.contiguous(), weight.scales[:, 0].to(KERNEL_DTYPE))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, shape[-1])
        if self.int8 is not None:
            codes, scales = self.int8
            y = torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), codes, scales).to(dtype)
        else:
            xk = self.grouped.gather(x).to(KERNEL_DTYPE).contiguous()
            y = self.planes[0](xk).to(dtype)
            for plane in self.planes[1:]:
                y += plane(xk)
        return y.reshape(*shape[:-1], self.out_features)

    def tensors(self) -> list[torch.Tensor]:
        """What the kernel keeps (for the weight-bytes count)."""
        if self.int8 is not None:
            return list(self.int8)
        index = [self.grouped.index] if self.grouped.index is not None else []
        return [t for plane in self.planes for t in plane.tensors()] + index


def choose_prompt_tiles(model: torch.nn.Module) -> None:
    """`--linear-path auto` on a CPU model: from how many rows each 4-bit plane's steps take
    the tiles, by measurement (int4_tiles.choose_tile_rows)."""
    planes = [
        plane
        for module in model.modules()
        if isinstance(getattr(module, "kernel", None), CpuIntKernel)
        for plane in module.kernel.planes
    ]
    if planes:
        choose_tile_rows(planes)
