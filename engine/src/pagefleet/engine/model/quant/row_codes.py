"""A quantized CPU weight's codes kept a byte each, in blocks of output rows, multiplied with
float32 activations: the fused one-row layers' linears (model/one_row_decode.py: 4-bit codes
as a second copy beside tinygemm's plane), and 8-bit codes' only kernel (quant/cpu_kernels.py).

At one row tinygemm reads the codes once, but its call, with the casts to and from bfloat16,
is one of a dozen torch calls per layer; the fused layers make the layer one call, and
`gemv_codes` is its GEMV. A loop along each row's columns, a reduction over a group of 32
codes, ran 2-3 G weights a second here (LLVM left it scalar). Laid out column by column within
a block of ROW_BLOCK output rows, the loop runs across the block's rows and vectorises; eight
columns are summed per pass over the block's sums, and the codes 2 KiB ahead are prefetched:
20 G weights a second from memory on an Intel Xeon (2 threads; 12 with one column per pass,
17 without the prefetch). A few rows (`gemm_codes`) convert each code once for all of them;
many take float32 tiles of the weight and torch's matmul (`RowCodes.matmul`). Groups are whole
multiples of 8 columns (quant/cpu_kernels.py's are 32 to 256).

Each code is kept as `code - 2^(bits - 1)` in an int8, its offset with that centre folded in
(`offset + 2^(bits - 1) * scale`, zero for symmetric codes: GGUF Q8_0 and Q4_0, symmetric
GPTQ): `w = c * scale + offset`, summed as `scale * sum(c x) + offset * sum(x)` per group in
float32, the dequantized float32 weight's product up to the order of the sums
(docs/benchmarks.md, issue 38).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from pagefleet.engine.attention import numba_paged
from pagefleet.engine.attention.numba_paged import prefetch
from pagefleet.engine.kernel_cache import match_torch_threads, use_image_kernels

use_image_kernels()  # before the kernel below is defined (and loaded or compiled)
KERNEL_CALLEES = (numba_paged.__file__,)  # its prefetch (kernel_cache.CalleeStamp)

ROW_BLOCK = 64  # output rows per block: four AVX-512 vectors of float32 sums
# How far ahead the codes are asked for: the hardware prefetcher alone left the loop waiting
# (17 G weights a second from memory; 20.5 with this, 19 at twice or half the distance).
PREFETCH_BYTES = 2048
_FAST = {"reassoc", "contract", "nsz", "arcp"}
_BLOCKS = numba.float32[:, :, ::1]
_VECTOR = numba.float32[::1]
_ROWS = numba.float32[:, ::1]
NO_BIAS = np.zeros(0, np.float32)


@numba.njit(inline="always")
def _group_sums(x, groups):
    """x summed over each run of its columns: what a group's offset multiplies."""
    size = x.shape[0] // groups
    sums = np.zeros(groups, np.float32)
    for j in range(groups):
        for k in range(j * size, (j + 1) * size):
            sums[j] += x[k]
    return sums


@numba.njit(inline="always")
def _store(acc, first, bias, add, out):
    """A block's sums into out[first:] (+ bias; added where `add`), its padding rows not."""
    for r in range(min(acc.shape[0], out.shape[0] - first)):
        value = acc[r] + bias[first + r] if bias.shape[0] else acc[r]
        if add:
            out[first + r] += value
        else:
            out[first + r] = value


def _gemv_signature(codes):
    """(codes, scales, offsets, x, bias, add, out) for codes of the numba type `codes`."""
    return numba.void(codes, _BLOCKS, _BLOCKS, _VECTOR, _VECTOR, numba.boolean, _VECTOR)


@numba.njit(
    _gemv_signature(numba.int8[:, :, ::1]),
    parallel=True,
    fastmath=_FAST,
    cache=True,
)
def gemv_codes(codes, scales, offsets, x, bias, add, out):
    """out = (or +=) W x (+ bias) for W in blocks: codes [blocks, in, ROW_BLOCK], scales and
    offsets [blocks, groups, ROW_BLOCK] (offsets [0, 0, 0]: none); out holds the real rows,
    the last block's padding is not written."""
    blocks, cols, _ = codes.shape
    groups = scales.shape[1]
    size = cols // groups
    flat = codes.reshape(-1)
    sums = _group_sums(x, groups) if offsets.shape[0] else np.zeros(groups, np.float32)
    for b in numba.prange(blocks):
        acc = np.zeros(ROW_BLOCK, np.float32)
        part = np.empty(ROW_BLOCK, np.float32)
        c = codes[b]
        for j in range(groups):
            part[:] = 0
            for k in range(j * size, (j + 1) * size, 8):  # eight columns per pass over `part`
                ahead = (b * cols + k) * ROW_BLOCK + PREFETCH_BYTES
                for t in range(8):
                    if ahead + t * ROW_BLOCK < flat.shape[0]:
                        prefetch(flat, ahead + t * ROW_BLOCK)
                x0, x1, x2, x3 = x[k], x[k + 1], x[k + 2], x[k + 3]
                x4, x5, x6, x7 = x[k + 4], x[k + 5], x[k + 6], x[k + 7]
                for r in range(ROW_BLOCK):
                    part[r] += (
                        (np.float32(c[k, r]) * x0 + np.float32(c[k + 1, r]) * x1)
                        + (np.float32(c[k + 2, r]) * x2 + np.float32(c[k + 3, r]) * x3)
                    ) + (
                        (np.float32(c[k + 4, r]) * x4 + np.float32(c[k + 5, r]) * x5)
                        + (np.float32(c[k + 6, r]) * x6 + np.float32(c[k + 7, r]) * x7)
                    )
            for r in range(ROW_BLOCK):
                acc[r] += part[r] * scales[b, j, r]
            if offsets.shape[0]:
                for r in range(ROW_BLOCK):
                    acc[r] += offsets[b, j, r] * sums[j]
        _store(acc, b * ROW_BLOCK, bias, add, out)


@numba.njit(inline="always")
def _nibble_block(packed, scales, offsets, x, sums, b, half):
    """Block b's sums of gemv_nibbles (`half`: half its rows)."""
    _, cols, _ = packed.shape
    groups = scales.shape[1]
    size = cols // groups
    flat = packed.reshape(-1)
    acc = np.zeros(2 * half, np.float32)
    # The low nibbles' rows and the high nibbles': apart, so LLVM sees they do not alias.
    low = np.empty(half, np.float32)
    high = np.empty(half, np.float32)
    c = packed[b]
    for j in range(groups):
        low[:] = 0
        high[:] = 0
        for k in range(j * size, (j + 1) * size, 8):
            ahead = (b * cols + k) * half + PREFETCH_BYTES
            for t in range(0, 8 * half, 64):
                if ahead + t < flat.shape[0]:
                    prefetch(flat, ahead + t)
            x0, x1, x2, x3 = x[k], x[k + 1], x[k + 2], x[k + 3]
            x4, x5, x6, x7 = x[k + 4], x[k + 5], x[k + 6], x[k + 7]
            for i in range(half):
                b0, b1, b2, b3 = c[k, i], c[k + 1, i], c[k + 2, i], c[k + 3, i]
                b4, b5, b6, b7 = c[k + 4, i], c[k + 5, i], c[k + 6, i], c[k + 7, i]
                low[i] += (
                    (np.float32(b0 & 15) * x0 + np.float32(b1 & 15) * x1)
                    + (np.float32(b2 & 15) * x2 + np.float32(b3 & 15) * x3)
                ) + (
                    (np.float32(b4 & 15) * x4 + np.float32(b5 & 15) * x5)
                    + (np.float32(b6 & 15) * x6 + np.float32(b7 & 15) * x7)
                )
                high[i] += (
                    (np.float32(b0 >> 4) * x0 + np.float32(b1 >> 4) * x1)
                    + (np.float32(b2 >> 4) * x2 + np.float32(b3 >> 4) * x3)
                ) + (
                    (np.float32(b4 >> 4) * x4 + np.float32(b5 >> 4) * x5)
                    + (np.float32(b6 >> 4) * x6 + np.float32(b7 >> 4) * x7)
                )
        for i in range(half):
            acc[i] += low[i] * scales[b, j, i] + offsets[b, j, i] * sums[j]
        for i in range(half):
            r = half + i
            acc[r] += high[i] * scales[b, j, r] + offsets[b, j, r] * sums[j]
    return acc


@numba.njit(
    _gemv_signature(numba.uint8[:, :, ::1]),
    parallel=True,
    fastmath=_FAST,
    cache=True,
)
def gemv_nibbles(packed, scales, offsets, x, bias, add, out):
    """gemv_codes on 4-bit codes as tinygemm packs them in blocks of B rows (64 on AVX-512
    builds, 32 on AVX2 ones): packed [blocks, in, B / 2], byte i holding row i in its low
    nibble and row B / 2 + i in its high one; scales and offsets [blocks, groups, B]; codes
    0..15 (not centred), offsets always given."""
    blocks, _, half = packed.shape
    sums = _group_sums(x, scales.shape[1])
    for b in numba.prange(blocks):
        if half == ROW_BLOCK // 2:  # the block a constant: LLVM vectorises a known count
            acc = _nibble_block(packed, scales, offsets, x, sums, b, ROW_BLOCK // 2)
        else:
            acc = _nibble_block(packed, scales, offsets, x, sums, b, half)
        _store(acc, b * 2 * half, bias, add, out)


@numba.njit(
    numba.void(numba.int8[:, :, ::1], _BLOCKS, _BLOCKS, _ROWS, _ROWS),
    parallel=True,
    fastmath=_FAST,
    cache=True,
)
def gemm_codes(codes, scales, offsets, x, out):
    """out [m, rows] = x [m, in] W^T for a few rows: each block's codes converted once, four
    columns at a time, for all m rows (gemv_codes's layout and sums)."""
    blocks, cols, _ = codes.shape
    m = x.shape[0]
    groups = scales.shape[1]
    size = cols // groups
    sums = np.zeros((m, groups), np.float32)
    if offsets.shape[0]:
        for i in range(m):
            sums[i] = _group_sums(x[i], groups)
    for b in numba.prange(blocks):
        acc = np.zeros((m, ROW_BLOCK), np.float32)
        part = np.empty((m, ROW_BLOCK), np.float32)
        wide = np.empty((4, ROW_BLOCK), np.float32)
        c = codes[b]
        for j in range(groups):
            part[:] = 0
            for k in range(j * size, (j + 1) * size, 4):
                for t in range(4):
                    for r in range(ROW_BLOCK):
                        wide[t, r] = np.float32(c[k + t, r])
                for i in range(m):
                    x0, x1, x2, x3 = x[i, k], x[i, k + 1], x[i, k + 2], x[i, k + 3]
                    sums_i = part[i]
                    for r in range(ROW_BLOCK):
                        sums_i[r] += (wide[0, r] * x0 + wide[1, r] * x1) + (
                            wide[2, r] * x2 + wide[3, r] * x3
                        )
            for i in range(m):
                for r in range(ROW_BLOCK):
                    acc[i, r] += part[i, r] * scales[b, j, r]
                if offsets.shape[0]:
                    for r in range(ROW_BLOCK):
                        acc[i, r] += offsets[b, j, r] * sums[i, j]
        for i in range(m):
            _store(acc[i], b * ROW_BLOCK, NO_BIAS, False, out[i])


@numba.njit(
    numba.void(numba.int8[:, :, ::1], _BLOCKS, _BLOCKS, numba.int64, _ROWS),
    parallel=True,
    fastmath={"reassoc", "nsz", "arcp"},  # no contraction: code * scale + offset as written
    cache=True,
)
def dequantize_tile(codes, scales, offsets, first_block, out):
    """out [in, width] = the float32 weights of blocks first_block .. + width / ROW_BLOCK,
    transposed (the right operand of x W^T)."""
    cols = codes.shape[1]
    size = cols // scales.shape[1]
    width = out.shape[1] // ROW_BLOCK
    for k in numba.prange(cols):
        j = k // size
        row = out[k]
        for t in range(width):
            c, s, at = codes[first_block + t, k], scales[first_block + t, j], t * ROW_BLOCK
            if offsets.shape[0]:
                o = offsets[first_block + t, j]
                for r in range(ROW_BLOCK):
                    row[at + r] = np.float32(c[r]) * s[r] + o[r]
            else:
                for r in range(ROW_BLOCK):
                    row[at + r] = np.float32(c[r]) * s[r]


NO_OFFSETS = np.zeros((0, 0, 0), np.float32)
TILE_BYTES = 1 << 20  # a float32 tile of the weight: within a core's L2 beside the rows


class OneRowWeight:
    """What the fused one-row layers and a float LM head's one-row path read of a weight kept
    as codes (RowCodes, PlaneCodes): its arrays in the fused kernel's order, and its
    product with one float32 row."""

    out_features: int
    scales: np.ndarray
    offsets: np.ndarray

    @property
    def in_features(self) -> int:
        raise NotImplementedError

    def fused_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(int8 codes, 4-bit plane, scales, offsets), the form not kept empty."""
        raise NotImplementedError

    def _gemv(self, row: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) for one float32 row x [1, in] (a new [1, out] tensor)."""
        if x.shape != (1, self.in_features) or x.dtype != torch.float32:
            raise ValueError(f"one float32 row of {self.in_features}, not {tuple(x.shape)}")
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"a bias of {self.out_features}, not {tuple(bias.shape)}")
        out = np.empty(self.out_features, np.float32)
        b = NO_BIAS if bias is None else bias.detach().float().contiguous().numpy()
        match_torch_threads()
        self._gemv(x.contiguous().numpy()[0], b, out)
        return torch.from_numpy(out).view(1, -1)

    def one_row(self, x, weight=None, bias=None, residual=None) -> torch.Tensor:
        """A float Linear's one-row path (model/linear.py's `one_row`) on these codes: its
        weight argument is the float copy they stand for, not read."""
        y = self(x, bias)
        return y if residual is None else residual.add_(y)


@dataclass(frozen=True)
class RowCodes(OneRowWeight):
    """A weight `w[n, k] = code * scale + offset` (a scale and an offset per group of
    columns) laid out for `gemv_codes` (see the module docstring)."""

    codes: np.ndarray  # [blocks, in, ROW_BLOCK] int8, centred
    scales: np.ndarray  # [blocks, groups, ROW_BLOCK] float32
    offsets: np.ndarray  # the same, centre folded in; NO_OFFSETS where every one is zero
    out_features: int

    @classmethod
    def of(cls, codes: torch.Tensor, bits: int, scales: torch.Tensor, offsets: torch.Tensor):
        """From codes [out, in] (0 .. 2^bits - 1, one per element) and their scales and
        offsets [out, groups] (float32), the groups contiguous runs of columns."""
        out, cols = codes.shape
        groups = scales.shape[1]
        if bits > 8 or cols % groups or (cols // groups) % 8 or offsets.shape != scales.shape:
            raise ValueError(
                f"{bits}-bit codes {tuple(codes.shape)} with scales {tuple(scales.shape)} and "
                f"offsets {tuple(offsets.shape)}"
            )
        centre = 1 << (bits - 1)
        centred = (codes.to(torch.int16) - centre).to(torch.int8)
        folded = offsets.float() + centre * scales.float()
        return cls(
            by_block(centred),
            by_block(scales.float()),
            by_block(folded) if bool(folded.any()) else NO_OFFSETS,
            out,
        )

    @classmethod
    def exact_int8(cls, weight: torch.Tensor, group: int = 32) -> RowCodes | None:
        """A float weight's own symmetric 8-bit codes, where each run of `group` columns holds
        integer multiples of its largest magnitude / 127 and nothing else: a GGUF Q8_0 tensor
        dequantized at load (an fp16 scale times an int8 code is exact in float32, and Q8_0's
        largest code is 127). None where any group is not so: the float weight stays."""
        out, cols = weight.shape
        if cols % group or group % 8 or weight.dtype != torch.float32:
            return None
        codes = torch.empty(out, cols, dtype=torch.uint8)
        scales = torch.empty(out, cols // group)
        for start in range(0, out, _CHECKED_ROWS):  # a few MiB of temporaries at a time
            w = weight[start : start + _CHECKED_ROWS].detach().reshape(-1, cols // group, group)
            part = w.abs().amax(dim=2) / 127
            unit = torch.where(part > 0, part, torch.ones_like(part)).unsqueeze(2)
            found = (w / unit).round()
            if not torch.equal(found * unit, w):  # also refuses NaN and infinities
                return None
            codes[start : start + w.shape[0]] = (found + 128).to(torch.uint8).view(-1, cols)
            scales[start : start + w.shape[0]] = part
        return cls.of(codes, 8, scales, -128 * scales)

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.offsets.nbytes

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.codes, self.scales, self.offsets

    def fused_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.codes, NO_PLANE, self.scales, self.offsets

    def _gemv(self, row: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
        gemv_codes(*self.arrays(), row, bias, False, out)

    def matmul(self, x: torch.Tensor, tile_rows: int | None = None) -> torch.Tensor:
        """x W^T for float32 rows x [m, in] (a new [m, out] tensor): from `tile_rows` rows
        (None: never) on float32 tiles of the weight, each dequantized once into a buffer of
        about TILE_BYTES and multiplied by torch's matmul; fewer rows on the codes as they
        are. The float weight is never held whole."""
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32:
            raise ValueError(f"float32 rows of {self.in_features}, not {tuple(x.shape)}")
        x = x.contiguous()
        match_torch_threads()
        if tile_rows is None or x.shape[0] < tile_rows:
            out = np.empty((x.shape[0], self.out_features), np.float32)
            if x.shape[0] == 1:
                gemv_codes(*self.arrays(), x.numpy()[0], NO_BIAS, False, out[0])
            else:
                gemm_codes(*self.arrays(), x.numpy(), out)
            return torch.from_numpy(out)
        blocks = self.codes.shape[0]
        per_tile = max(1, TILE_BYTES // (4 * ROW_BLOCK * self.in_features))
        out = torch.empty(x.shape[0], blocks * ROW_BLOCK)
        buffer = np.empty(self.in_features * min(blocks, per_tile) * ROW_BLOCK, np.float32)
        for first in range(0, blocks, per_tile):
            count = min(per_tile, blocks - first)
            tile = buffer[: self.in_features * count * ROW_BLOCK].reshape(self.in_features, -1)
            dequantize_tile(*self.arrays(), first, tile)
            at = first * ROW_BLOCK
            out[:, at : at + count * ROW_BLOCK] = torch.mm(x, torch.from_numpy(tile))
        return out[:, : self.out_features]

    def hold_in(self, module: torch.nn.Module, prefix: str) -> None:
        """Keep these arrays as `module`'s non-persistent buffers (`{prefix}_codes`, ...): a
        copy made for the fused layers then counts with the module's weights
        (model/linear.py's weight_bytes) and lives as long as the module."""
        for name, array in zip(("codes", "scales", "offsets"), self.arrays(), strict=True):
            module.register_buffer(f"{prefix}_{name}", torch.from_numpy(array), persistent=False)


@dataclass(frozen=True)
class PlaneCodes(OneRowWeight):
    """A 4-bit weight read in tinygemm's own packed bytes (quant/cpu_kernels.py's plane, in
    its blocks of B rows: no second copy of the codes), with its exact float32 scales and
    offsets in blocks of B rows, for `gemv_nibbles`."""

    packed: np.ndarray  # [blocks, in, B / 2] uint8: a view of the plane's bytes
    scales: np.ndarray  # [blocks, groups, B] float32
    offsets: np.ndarray
    out_features: int

    @classmethod
    def of(cls, packed: torch.Tensor, block: int, scales: torch.Tensor, offsets: torch.Tensor):
        """From tinygemm's `packed` [rows, in / 2] in blocks of `block` rows (this build's:
        int4_tiles.tinygemm_block) and the scales and offsets [out, groups] of codes 0..15;
        None where the rows are not whole blocks."""
        rows, cols = packed.shape[0], 2 * packed.shape[1]
        out, groups = scales.shape
        if block % 2 or rows % block or out > rows or cols % groups or (cols // groups) % 8:
            return None
        if offsets.shape != scales.shape:
            raise ValueError(f"offsets {tuple(offsets.shape)} for scales {tuple(scales.shape)}")
        blocks = rows // block
        view = packed.view(torch.uint8).numpy().reshape(blocks, cols, block // 2)
        scales, offsets = (by_block(t.float(), blocks, block) for t in (scales, offsets))
        return cls(view, scales, offsets, out)

    @property
    def in_features(self) -> int:
        return self.packed.shape[1]

    def fused_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return NO_CODES, self.packed, self.scales, self.offsets

    def tensors(self) -> list[torch.Tensor]:
        """What it keeps beside the plane's bytes (for the weight-bytes count)."""
        return [torch.from_numpy(self.scales), torch.from_numpy(self.offsets)]

    def _gemv(self, row: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
        gemv_nibbles(self.packed, self.scales, self.offsets, row, bias, False, out)


def by_block(t: torch.Tensor, blocks: int | None = None, block: int = ROW_BLOCK) -> np.ndarray:
    """[out, c] -> [blocks, c, block] (rows past `out` zero), the kernels' layout."""
    out = t.shape[0]
    blocks = -(-out // block) if blocks is None else blocks
    padded = t.new_zeros(blocks * block, t.shape[1])
    padded[:out] = t
    return padded.view(blocks, block, -1).transpose(1, 2).contiguous().numpy()


_CHECKED_ROWS = 2048
NO_CODES = np.zeros((0, 0, 0), np.int8)
NO_PLANE = np.zeros((0, 0, 0), np.uint8)
