"""A W8A8 int8 linear's activation quantization and output scaling on a CPU as numba kernels
(quant/cpu_int8.py), at decode sizes.

Around oneDNN's int8 GEMM, torch dispatched about a dozen ops a linear: the activations'
largest magnitude, the factor, the product, the rounding and the cast on the way in; the row
scale, the column scale and the bias on the way out. At a few rows that glue took about as
long as the GEMM. Here each end is one compiled call. Both do torch's float32 operations in
torch's order (reciprocal then times 127, round half to even, separate multiplies, no fused
multiply-add), so the codes, scales and outputs are bit for bit quantize_rows_int8's and
Int8MatMul's (tests/test_numba_ops.py): a code off by one at a rounding tie would flip later
layers' codes.

quant/kernels.py's quantize_rows_int8 and scale_sums, which every W8A8 kernel calls, take these
where they apply. A CPU W8A8 model imports this module at load (quant/cpu_int8.py); no other
model compiles these kernels.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from pagefleet.engine.model.numba_ops import no_gradient

_ROWS = numba.float32[:, ::1]
_VECTOR = numba.float32[::1]


@numba.njit(numba.boolean(_VECTOR), fastmath={"reassoc"}, cache=True)
def _finite_row(row):
    """Whether a row holds no NaN and no infinity: v - v is 0 for a finite v and NaN
    otherwise, and a NaN survives any order of the sum (so LLVM may vectorise it)."""
    total = np.float32(0.0)
    for v in row:
        total += v - v
    return total == 0


_LANES = 16  # running maxima side by side: LLVM vectorises these, not a single running max


@numba.njit(numba.float32(_VECTOR, _VECTOR), cache=True)
def _largest_magnitude(row, lanes):
    """max |row| of a finite row (`lanes`: scratch of _LANES floats)."""
    lanes[:] = 0
    whole = row.shape[0] - row.shape[0] % _LANES
    for start in range(0, whole, _LANES):
        for j in range(_LANES):
            magnitude = abs(row[start + j])
            lanes[j] = magnitude if magnitude > lanes[j] else lanes[j]
    largest = np.float32(0.0)
    for v in lanes:
        largest = v if v > largest else largest
    for v in row[whole:]:
        largest = abs(v) if abs(v) > largest else largest
    return largest


@numba.njit(numba.void(_ROWS, numba.int8[:, ::1], _ROWS), cache=True)
def _int8_rows(x, codes, scales):
    """Each row's int8 codes and scale, op for op as quant/kernels.py's quantize_rows_int8
    (dynamic scales) computes them in torch: largest magnitude (at least 1e-12), factor =
    reciprocal(largest) * 127, codes = round-half-even(x * factor), scale = largest * (1/127),
    each a float32 operation, no fused multiply-add: the same codes and scales bit for bit.
    A row holding a NaN or an infinity gets torch's answer for it: its scale NaN or inf, its
    codes 0 (every product is 0 or NaN, and torch casts a NaN to 0)."""
    rows, cols = x.shape
    lanes = np.empty(_LANES, np.float32)
    for r in range(rows):
        row = x[r]
        if not _finite_row(row):
            largest = np.float32(np.nan) if np.isnan(row).any() else np.float32(np.inf)
            codes[r, :] = 0
            scales[r, 0] = largest * np.float32(1.0 / 127.0)
            continue
        largest = max(_largest_magnitude(row, lanes), np.float32(1e-12))
        factor = (np.float32(1.0) / largest) * np.float32(127.0)
        for c in range(cols):
            codes[r, c] = np.int8(np.rint(row[c] * factor))
        scales[r, 0] = largest * np.float32(1.0 / 127.0)


@numba.njit(numba.void(_ROWS, _ROWS, _VECTOR, _VECTOR, _ROWS), cache=True)
def _scale_sums(sums, row_scales, scales, bias, out):
    """out = sums * row scale * column scale (+ bias where given), in that order, as torch's
    `(acc * a).mul_(scale) + bias` rounds it."""
    rows, cols = sums.shape
    for r in range(rows):
        a = row_scales[r, 0]
        if bias.shape[0]:
            for c in range(cols):
                out[r, c] = (sums[r, c] * a) * scales[c] + bias[c]
        else:
            for c in range(cols):
                out[r, c] = (sums[r, c] * a) * scales[c]


# Up to this many activations the one-thread kernels beat torch's ops; past it (prompt chunks,
# large batches) torch's ops run on every thread and win (64 x 1536: 110 against 81 us here).
INT8_KERNEL_ELEMENTS = 32768


def kernels_take(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether these kernels cover an operand `x` (activations, or a product's sums): on the
    CPU, decode-sized, no gradient wanted of it or of `others` (autograd keeps torch's ops).
    The callers (quant/kernels.py) check the dtypes."""
    return (
        x.device.type == "cpu"
        and x.numel() <= INT8_KERNEL_ELEMENTS
        and no_gradient(x, *(t for t in others if t is not None))
    )


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row int8 codes [rows, in] and float32 scales [rows, 1] of float32 CPU rows
    (quantize_rows_int8's, in one call)."""
    codes = np.empty(x.shape, np.int8)
    scales = np.empty((x.shape[0], 1), np.float32)
    _int8_rows(x.contiguous().numpy(), codes, scales)
    return torch.from_numpy(codes), torch.from_numpy(scales)


_NO_BIAS = np.empty(0, np.float32)


def scale_sums(
    sums: torch.Tensor, row_scales: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """float32 int8-product sums [rows, out] scaled per row and per column, plus the bias."""
    out = np.empty(sums.shape, np.float32)
    extra = _NO_BIAS if bias is None else bias.detach().float().contiguous().numpy()
    rows, columns = row_scales.contiguous().numpy(), scales.contiguous().numpy()
    _scale_sums(sums.contiguous().numpy(), rows, columns, extra, out)
    return torch.from_numpy(out)
