"""Triton weight-only GEMMs for GPUs: W4A16 and W8A16 over the canonical codes.

y[m, n] = sum_k x[m, k] * (code[n, k] * scale[n, g] + offset[n, g]), g = k // GROUP, with the
codes unpacked and scaled tile by tile in registers: the weight is read as stored, never
dequantized to memory. 4-bit codes hold input columns 2j and 2j+1 in the low and high nibble
of byte j, so a tile multiplies the even columns of x by the low nibbles and the odd columns by
the high ones (two dots, no interleave). Act-order weights arrive with contiguous groups and a
gather of x (quant/int_weight.py). Tested in Triton's interpreter on CPU tensors; timed only
on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit
def _int_weight_matmul(
    x_ptr,
    codes_ptr,
    scales_ptr,
    offsets_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_cn,
    stride_sn,
    stride_ym,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BITS == 8:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            wk = k_ok[:, None] & n_ok[None, :]
            codes = tl.load(
                codes_ptr + offs_n[None, :] * stride_cn + offs_k[:, None], mask=wk, other=0
            )
            at = offs_n[None, :] * stride_sn + (offs_k // GROUP)[:, None]
            scale = tl.load(scales_ptr + at, mask=wk, other=0.0)
            offset = tl.load(offsets_ptr + at, mask=wk, other=0.0)
            w = codes.to(tl.float32) * scale + offset
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        for k0 in range(0, K, BLOCK_K):
            offs_j = k0 // 2 + tl.arange(0, HALF)  # byte j holds columns 2j and 2j + 1
            even, odd = 2 * offs_j, 2 * offs_j + 1
            j_ok = even < K
            xm = m_ok[:, None] & j_ok[None, :]
            x_even = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + even[None, :], mask=xm, other=0.0
            )
            x_odd = tl.load(x_ptr + offs_m[:, None] * stride_xm + odd[None, :], mask=xm, other=0.0)
            wk = j_ok[:, None] & n_ok[None, :]
            byte = tl.load(
                codes_ptr + offs_n[None, :] * stride_cn + offs_j[:, None], mask=wk, other=0
            ).to(tl.int32)
            at_even = offs_n[None, :] * stride_sn + (even // GROUP)[:, None]
            at_odd = offs_n[None, :] * stride_sn + (odd // GROUP)[:, None]
            w_lo = (byte & 15).to(tl.float32) * tl.load(
                scales_ptr + at_even, mask=wk, other=0.0
            ) + tl.load(offsets_ptr + at_even, mask=wk, other=0.0)
            w_hi = (byte >> 4).to(tl.float32) * tl.load(
                scales_ptr + at_odd, mask=wk, other=0.0
            ) + tl.load(offsets_ptr + at_odd, mask=wk, other=0.0)
            acc += tl.dot(x_even, w_lo.to(x_even.dtype), input_precision=DOT_PRECISION)
            acc += tl.dot(x_odd, w_hi.to(x_odd.dtype), input_precision=DOT_PRECISION)
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int_weight_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """x `[M, K]` times the weight `codes` (`[N, K * bits / 8]` uint8, quant/packing.py) with
    `scales`/`offsets` `[N, K / group_size]` (float32): `[M, N]` in x's dtype."""
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int_weight_matmul[grid](
        x,
        codes,
        scales,
        offsets,
        y,
        m,
        n,
        k,
        x.stride(0),
        codes.stride(0),
        scales.stride(0),
        y.stride(0),
        GROUP=group_size,
        BITS=bits,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return y
