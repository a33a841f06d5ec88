"""A float32 CPU step's small per-layer ops (RMSNorm, the rotary rotation, a W8A8 linear's
activation quantization and output scaling) as numba kernels.

At a decode step's few rows torch spends more on dispatching an op's several kernels than on
the arithmetic: RMSNorm of one 576-wide row takes ~13 us as torch runs it and ~4 us here, the
rotation of one token's q and k ~24 us against ~8 us (benchmarks/cpu_small_ops.py). The
layers call these where the tensors are float32 on the CPU and keep torch's ops elsewhere
(other dtypes, GPUs, autograd).

The rotation does HF's operations in HF's order, without contraction into fused multiply-adds,
so it is bit for bit torch's (tests/test_numba_ops.py), as are the int8 codes, scales and
scaled sums (quant/cpu_int8.py: two calls where torch dispatched a dozen ops per linear). The
norm's sum of squares is reassociated (vectorised), as torch's own reduction is: its last bits
differ from torch's the way torch's differ from HF's.

The kernels have explicit signatures: compiled (or loaded from numba's on-disk cache) when
this module is first imported, which the model does once its float32 CPU weights are loaded
(`warm_up`), so no request pays for a compile.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

_FAST = {"reassoc", "contract", "nsz", "arcp"}

# C-contiguous signatures: LLVM vectorises the inner loops only over unit strides.
_ROWS = numba.float32[:, ::1]
_VECTOR = numba.float32[::1]
_HEADS = numba.float32[:, :, ::1]
_INT = numba.int64


@numba.njit(numba.void(_ROWS, _VECTOR, numba.float32, _ROWS), fastmath=_FAST, cache=True)
def _rms_norm(x, weight, eps, out):
    """out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps))."""
    rows, dim = x.shape
    for r in range(rows):
        squares = np.float32(0.0)
        for d in range(dim):
            squares += x[r, d] * x[r, d]
        inv = np.float32(1.0) / np.sqrt(squares / np.float32(dim) + eps)
        for d in range(dim):
            out[r, d] = weight[d] * (x[r, d] * inv)


@numba.njit(inline="always")
def _rotate(flat, row_stride, cos, sin, out):
    """out = x * cos + swap_halves(x) * sin over each head's first cos.shape[2] dims (the
    rest copied), where x [tokens, heads, head_dim] is read from `flat` with tokens
    `row_stride` apart (a view of a fused q/k/v output) and its heads packed in a row;
    cos/sin [tokens, 1, rotary] have rotate_half's minus sign already in sin's first half
    (model/rope.py's `Rotation`)."""
    tokens, heads, head_dim = out.shape
    rotary = cos.shape[2]
    half = rotary // 2
    for t in range(tokens):
        c, s = cos[t, 0], sin[t, 0]
        for h in range(heads):
            src = flat[t * row_stride + h * head_dim : t * row_stride + (h + 1) * head_dim]
            dst = out[t, h]
            for d in range(half):
                dst[d] = src[d + half] * s[d] + src[d] * c[d]
                dst[d + half] = src[d] * s[d + half] + src[d + half] * c[d + half]
            for d in range(rotary, head_dim):
                dst[d] = src[d]


@numba.njit(numba.void(_VECTOR, _INT, _VECTOR, _INT, _HEADS, _HEADS, _HEADS, _HEADS), cache=True)
def _rotate_pair(q_flat, q_stride, k_flat, k_stride, cos, sin, q_out, k_out):
    """q and k of a step rotated in one call (see _rotate)."""
    _rotate(q_flat, q_stride, cos, sin, q_out)
    _rotate(k_flat, k_stride, cos, sin, k_out)


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


def norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` covers this RMSNorm: float32 rows on the CPU, as wide as the float32
    weight, no gradient wanted (autograd keeps torch's ops)."""
    return (
        x.dim() == 2
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.shape[-1] == weight.shape[-1]
        and _no_gradient(x, weight)
    )


def rotation_applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rotate` covers this rotation: float32 q and k on the CPU of one head size, the
    step's cos/sin one float32 row per token (as model/rope.py's `at` makes them) over at most
    a head's dims, no gradient wanted."""
    tokens, _, head_dim = q.shape
    return (
        q.dtype == k.dtype == cos.dtype == torch.float32
        and q.device.type == "cpu"
        and k.shape[0] == tokens
        and k.shape[2] == head_dim
        and cos.shape[0] == tokens
        and cos.shape[2] <= head_dim
        and _no_gradient(q, k)
    )


# Up to this many activations the one-thread kernels beat torch's ops; past it (prompt chunks,
# large batches) torch's ops run on every thread and win (64 x 1536: 110 against 81 us here).
INT8_KERNEL_ELEMENTS = 32768


def int8_applies(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `int8_rows` and `scale_sums` cover a W8A8 linear's float32 CPU rows: decode
    sizes, no gradient wanted (autograd keeps torch's ops)."""
    extra = () if bias is None else (bias,)
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.numel() <= INT8_KERNEL_ELEMENTS
        and _no_gradient(x, *extra)
    )


def _no_gradient(*tensors: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a 2-D float32 CPU tensor's rows (a new tensor)."""
    out = np.empty(x.shape, np.float32)
    _rms_norm(x.contiguous().numpy(), weight.detach().contiguous().numpy(), np.float32(eps), out)
    return torch.from_numpy(out)


def rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [tokens, heads, head_dim] rotated (new tensors). Each may be a view of a wider
    row (of a fused q/k/v output): read in place where each row's heads are packed, copied
    first otherwise."""
    (q_flat, q_stride), (k_flat, k_stride) = _rows(q), _rows(k)
    q_out, k_out = np.empty(q.shape, np.float32), np.empty(k.shape, np.float32)
    trig = cos.contiguous().numpy(), sin.contiguous().numpy()
    _rotate_pair(q_flat, q_stride, k_flat, k_stride, *trig, q_out, k_out)
    return torch.from_numpy(q_out), torch.from_numpy(k_out)


def _rows(x: torch.Tensor) -> tuple[np.ndarray, int]:
    """x [tokens, heads, head_dim] as one flat array over its rows, and the rows' stride."""
    tokens, heads, head_dim = x.shape
    strides = x.stride()
    if strides[2] != 1 or strides[1] != head_dim:
        x, strides = x.contiguous(), (heads * head_dim, head_dim, 1)
    row_stride = strides[0] if tokens > 1 else heads * head_dim
    return x.as_strided(((tokens - 1) * row_stride + heads * head_dim,), (1,)).numpy(), row_stride


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


def warm_up() -> None:
    """Run each kernel once on a tiny input (importing this module compiled or loaded them)."""
    x = torch.ones(1, 2, 4)
    rms_norm(x[0], torch.ones(4), 1e-6)
    rotate(x, x, torch.ones(1, 1, 2), torch.zeros(1, 1, 2))
