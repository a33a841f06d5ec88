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
- other 8-bit codes (groups, zero points, GGUF Q8_0): kept a byte each in blocks of rows
  (quant/row_codes.py), with float32 activations, scales and offsets: a few rows on numba
  loops over the codes, many (from the row count measured on this machine and shape, as for
  the 4-bit tiles) on float32 tiles and torch's matmul, both the dequantized weight's float32
  product up to the order of the sums. tinygemm ran them as two 4-bit planes (`16 hi + lo`),
  1.3-2.5x slower from 2 to 256 rows on an Intel Xeon (docs/benchmarks.md, issue 38).
"""

from __future__ import annotations

import torch

from pagefleet.engine.model.quant import int4_tiles
from pagefleet.engine.model.quant.int4_tiles import Int4Tiles, choose_tile_rows, tinygemm_block
from pagefleet.engine.model.quant.int_weight import GroupedInt, IntWeight
from pagefleet.engine.model.quant.packing import unpack_codes
from pagefleet.engine.model.quant.row_codes import OneRowWeight, PlaneCodes, RowCodes

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

    PATHS = int4_tiles.PATHS
    MEASURED_ROWS = int4_tiles.MEASURED_ROWS

    def tile_subject(self) -> str | None:
        """What the per-machine cache keeps this shape's measurement under (None: no tiles)."""
        if self.tiles is None:
            return None
        return f"int4 tiles {self.out_features}x{self.tiles.k} group {self.group_size}"

    def tile_paths(self, rows: int) -> dict:
        x = torch.randn(rows, self.tiles.k).to(KERNEL_DTYPE)
        return {"tinygemm": lambda: self.tinygemm(x), "tiles": lambda: self.tiles(x)}

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


class CodesPlane:
    """8-bit codes a byte each in float32 (quant/row_codes.py): steps of a few rows on the
    codes as they are, from `tile_rows` rows (None: never; set by the load's measurement,
    int4_tiles.choose_tile_rows, or by the caller) on float32 tiles."""

    PATHS = ("codes", "tiles")
    # Tiles of float32 weights overtook the codes from 32-64 rows here; 2 to 8 rows ran on the
    # codes 1.3-1.7x faster than tinygemm's two planes did (docs/benchmarks.md, issue 38).
    MEASURED_ROWS = (16, 64, 256)

    def __init__(self, codes: RowCodes, group_size: int) -> None:
        self.codes = codes
        self.group_size = group_size
        self.tile_rows: int | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.codes.matmul(x, self.tile_rows)

    def tile_subject(self) -> str:
        c = self.codes
        return f"int8 code tiles {c.out_features}x{c.in_features} group {self.group_size}"

    def tile_paths(self, rows: int) -> dict:
        x = torch.randn(rows, self.codes.in_features)
        return {"codes": lambda: self.codes.matmul(x), "tiles": lambda: self.codes.matmul(x, 1)}

    def tensors(self) -> list[torch.Tensor]:
        return [torch.from_numpy(a) for a in self.codes.arrays()]


class CpuIntKernel:
    """y = x W^T for an `IntWeight`, on torch's packed CPU kernels (see the module docstring)."""

    def __init__(self, weight: IntWeight) -> None:
        self.out_features = weight.out_features
        self.grouped: GroupedInt | None = None
        self.int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.planes: list[TinyGemmPlane] = []
        self.codes: CodesPlane | None = None
        self.plane_codes: PlaneCodes | None = None  # the fused one-row layers' view of a plane
        symmetric = bool(torch.equal(weight.offsets, -128 * weight.scales))
        if weight.bits == 8 and weight.g_idx is None and weight.scales.shape[1] == 1 and symmetric:
            self._per_row_int8(weight)
            return
        g = weight.contiguous_groups(TINYGEMM_GROUPS)
        self.grouped = g
        codes = unpack_codes(g.codes, g.bits)
        if g.bits == 4:
            # tinygemm computes (q - 8) * scale + zero; ours is q * scale + offset.
            zeros = g.offsets + 8 * g.scales
            self.planes = [TinyGemmPlane(codes.to(torch.int32), g.scales, zeros, g.group_size)]
            block = tinygemm_block()
            if g.index is None and block is not None:
                self.plane_codes = PlaneCodes.of(self.planes[0].packed, block, g.scales, g.offsets)
        else:
            self.codes = CodesPlane(RowCodes.of(codes, 8, g.scales, g.offsets), g.group_size)
        # Only the planes or the byte codes are kept (each with its own scales).
        g.codes, g.scales, g.offsets = g.codes[:0], g.scales[:0], g.offsets[:0]

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
        elif self.codes is not None:
            y = self.codes(self.grouped.gather(x).float()).to(dtype)
        else:
            y = self.planes[0](self.grouped.gather(x).to(KERNEL_DTYPE).contiguous()).to(dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def row_codes(self) -> OneRowWeight | None:
        """The weight as the fused one-row layers read it (quant/row_codes.py): 8-bit codes
        as kept, 4-bit ones in tinygemm's plane itself with exact float32 scales and offsets
        (PlaneCodes, in the build's blocks of rows: 64 on AVX-512, 32 on AVX2); None for
        per-row int8, gathered (act-order) columns, rows short of a whole block, or a build
        whose layout int4_tiles does not read."""
        if self.grouped is None or self.grouped.index is not None:
            return None
        return self.codes.codes if self.codes is not None else self.plane_codes

    def tensors(self) -> list[torch.Tensor]:
        """What the kernel keeps (for the weight-bytes count)."""
        if self.int8 is not None:
            return list(self.int8)
        index = [self.grouped.index] if self.grouped.index is not None else []
        codes = self.codes.tensors() if self.codes is not None else []
        if self.plane_codes is not None:
            codes += self.plane_codes.tensors()
        return [t for plane in self.planes for t in plane.tensors()] + codes + index


def choose_prompt_tiles(model: torch.nn.Module) -> None:
    """`--linear-path auto` on a CPU model: from how many rows each 4-bit plane's and 8-bit
    weight's steps take their tiles, by measurement (int4_tiles.choose_tile_rows)."""
    kernels = [
        module.kernel
        for module in model.modules()
        if isinstance(getattr(module, "kernel", None), CpuIntKernel)
    ]
    planes = [p for k in kernels for p in k.planes] + [k.codes for k in kernels if k.codes]
    if planes:
        choose_tile_rows(planes)
