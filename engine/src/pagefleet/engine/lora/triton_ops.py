"""The LoRA delta's two halves on GPU as Triton kernels (punica's BGMV shape): one program per
(row, block of outputs) reads the row's adapter slot and multiplies the row by that slot's
weights, so rows of any number of adapters share one launch; a base-model row (slot -1) writes
nothing. One kernel serves both halves: `y[row, n] (+)= sum_k x[row, k] * W[slot, n, k]` with
W given by strides (shrink: A as [slots, width, in]; expand: B's columns as [slots, out, width]).

Tested on CPU tensors in Triton's interpreter (tests/test_lora_kernels.py); timings only on a
GPU. Each program re-reads its slot's weights: right for decode steps (few rows per adapter);
a prompt chunk's rows would share a tile in a segment-tiled (SGMV) kernel, not built yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.engine.lora.ops import LoRABatch

BLOCK_N = 32
BLOCK_K = 64


@triton.jit
def _gathered_matvec(
    x_ptr,
    w_ptr,
    y_ptr,
    slot_ptr,
    n_out,
    n_in,
    stride_xr,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_yr,
    ACCUMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    w_base = w_ptr + slot.to(tl.int64) * stride_ws
    for k0 in range(0, n_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xr + offs_k, mask=offs_k < n_in, other=0.0)
        w = tl.load(
            w_base + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
            mask=(offs_n[:, None] < n_out) & (offs_k[None, :] < n_in),
            other=0.0,
        )
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    y_ptrs = y_ptr + row * stride_yr + offs_n
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=offs_n < n_out, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=offs_n < n_out)


def _launch(x, w, strides, y, slots, n_out: int, n_in: int, accumulate: bool) -> None:
    grid = (x.shape[0], triton.cdiv(n_out, BLOCK_N))
    _gathered_matvec[grid](
        x,
        w,
        y,
        slots,
        n_out,
        n_in,
        x.stride(0),
        *strides,
        y.stride(0),
        ACCUMULATE=accumulate,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


class TritonKernels:
    name = "triton"

    @staticmethod
    def shrink(
        x: torch.Tensor, a: torch.Tensor, batch: LoRABatch, width: int, present: list[bool]
    ) -> torch.Tensor:
        x = x.contiguous()
        t = x.new_zeros(x.shape[0], width)
        n_in = a.shape[1]
        strides = (width * a.stride(0), a.stride(0), a.stride(1))
        _launch(x, a, strides, t, batch.row_slots, width, n_in, accumulate=False)
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
        t = t.contiguous()
        strides = (width * b.stride(1), b.stride(0), b.stride(1))
        if y.stride(1) != 1:
            raise ValueError("the LoRA expand kernel writes rows of contiguous outputs")
        _launch(t, b, strides, y, batch.row_slots, b.shape[0], width, accumulate=True)
