"""A float32 CPU step's small per-layer ops (RMSNorm, the rotary rotation) and its one-row
linears (a GEMV) as numba kernels.

At a decode step's few rows torch spends more on dispatching an op's several kernels than on
the arithmetic: RMSNorm of one 576-wide row takes ~13 us as torch runs it and ~4 us here, the
rotation of one token's q and k ~24 us against ~8 us (benchmarks/cpu_small_ops.py). The
layers call these where the tensors are float32 on the CPU and keep torch's ops elsewhere
(other dtypes, GPUs, autograd).

The rotation does HF's operations in HF's order, without contraction into fused multiply-adds,
so it is bit for bit torch's (tests/test_numba_ops.py). The norm's sum of squares is
reassociated (vectorised), as torch's own reduction is: its last bits differ from torch's the
way torch's differ from HF's.

A one-row linear is bound by reading its weight. On an AVX2 AMD EPYC (Zen 3) MKL's sgemv read
the model's weights at 9-13 GB/s and oneDNN's packed kernel at 10-19, where a plain loop over
the rows, split between the threads, reads them at 21-23 (docs/benchmarks.md, issue 38); where
it runs is chosen per machine by measurement (model/linear_plan.py). Its sums are reassociated
too (vectorised), as MKL's and oneDNN's are.

The kernels have explicit signatures: compiled (or loaded from numba's on-disk cache) when
this module is first imported, which the model does once its float32 CPU weights are loaded
(`warm_up`), so no request pays for a compile.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from pagefleet.engine.kernel_cache import match_torch_threads, use_image_kernels
from pagefleet.engine.model.packed import plain_linear

use_image_kernels()  # before the kernels below are defined (and loaded or compiled)

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


_GEMV_BLOCK = 16  # output rows per work item: enough items to balance threads on a narrow weight


@numba.njit(
    numba.void(_ROWS, _VECTOR, _VECTOR, numba.boolean, _VECTOR),
    parallel=True,
    fastmath=_FAST,
    cache=True,
)
def _gemv(weight, x, bias, add, out):
    rows, cols = weight.shape
    for block in numba.prange((rows + _GEMV_BLOCK - 1) // _GEMV_BLOCK):
        for r in range(block * _GEMV_BLOCK, min(rows, (block + 1) * _GEMV_BLOCK)):
            acc = np.float32(0.0)
            for i in range(cols):
                acc += weight[r, i] * x[i]
            if bias.shape[0]:
                acc += bias[r]
            if add:
                out[r] += acc
            else:
                out[r] = acc


def norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` covers this RMSNorm: float32 rows on the CPU, as wide as the float32
    weight, no gradient wanted (autograd keeps torch's ops)."""
    return (
        x.dim() == 2
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.shape[-1] == weight.shape[-1]
        and no_gradient(x, weight)
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
        and no_gradient(q, k)
    )


def no_gradient(*tensors: torch.Tensor) -> bool:
    """Whether autograd wants nothing of these tensors (a kernel's output would not record)."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def linear_one_row(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) for one float32 row on the CPU, added into `residual` in place when one is
    given (and returned); torch's linear where the kernel does not apply (autograd, another
    dtype, a strided output)."""
    if not _gemv_applies(x, weight, bias, residual):
        return plain_linear(x, weight, bias, residual)
    match_torch_threads()
    row = x.contiguous().numpy()[0]
    b = _NO_BIAS if bias is None else bias.detach().contiguous().numpy()
    if residual is not None:
        _gemv(weight.detach().numpy(), row, b, True, residual.numpy()[0])
        return residual
    out = np.empty(weight.shape[0], np.float32)
    _gemv(weight.detach().numpy(), row, b, False, out)
    return torch.from_numpy(out).view(1, -1)


_NO_BIAS = np.empty(0, np.float32)  # read-only in effect: the kernel only reads a bias


def _gemv_applies(x, weight, bias, residual) -> bool:
    """The kernel checks no bounds: every shape is checked here (a mismatch keeps torch's op,
    which raises), and an output sharing memory with the input keeps torch's too."""
    tensors = [t for t in (x, weight, bias, residual) if t is not None]
    rows, cols = weight.shape if weight.dim() == 2 else (-1, -1)
    return (
        x.dim() == 2
        and x.shape == (1, cols)
        and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
        and weight.is_contiguous()
        and (bias is None or bias.shape == (rows,))
        and (
            residual is None
            or (
                residual.is_contiguous()
                and residual.shape == (1, rows)
                and not _overlap(residual, x)
            )
        )
        and no_gradient(*tensors)
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + a.numel() * a.element_size()
    b_end = b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end


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


def warm_up() -> None:
    """Run each kernel once on a tiny input (importing this module compiled or loaded them)."""
    x = torch.ones(1, 2, 4)
    rms_norm(x[0], torch.ones(4), 1e-6)
    rotate(x, x, torch.ones(1, 1, 2), torch.zeros(1, 1, 2))
    linear_one_row(x[0, :1], torch.ones(3, 4), torch.ones(3))
