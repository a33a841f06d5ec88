"""The GPU path of the experts (model/experts.py): two grouped-GEMM Triton launches for all
experts of a layer, with no host synchronisation, so decode steps stay graph-capturable.

The (token, expert) pairs are sorted by expert once and laid out in blocks of BLOCK_M rows, each
expert's run padded to a whole number of blocks (`align_pairs`, torch ops of fixed sizes: the
worst-case layout, T x k + experts x (BLOCK_M - 1) rows, is allocated whatever the routing, and
blocks past the last expert's exit at once). Each program of the grouped GEMM takes one block:
it loads its rows (a token's hidden state, or a pair's activation) and multiplies them by its
expert's matrix. Launch one computes gate|up per pair, SiLU x up runs in torch, launch two the
down projection scaled by the router weight; a token's pairs are then summed over its k slots.
Pairs whose expert is on another rank (expert parallelism) take no block and add nothing.

Tested on CPU with TRITON_INTERPRET=1 against the torch grouped path (timings need a GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagefleet.engine.model.experts import count_per_expert


@triton.jit
def _grouped_gemm(
    a_ptr,  # [rows, K]: row of pair p is p // A_ROW_DIV
    b_ptr,  # [experts, N, K]
    c_ptr,  # [pairs, N]
    pairs_ptr,  # [blocks x BLOCK_M]: a pair per row, num_pairs = none
    block_expert_ptr,  # [blocks]: the block's local expert, -1 = no work
    weight_ptr,  # [pairs]: router weights (MUL_WEIGHT)
    num_pairs,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    valid = pair < num_pairs
    a_row = pair // A_ROW_DIV
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(
            a_ptr + a_row[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + pair[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & n_ok[None, :],
    )


def block_m_for(num_pairs: int) -> int:
    """Rows per block: 16 (tl.dot's least) for decode-sized batches, 64 for prompts."""
    return 16 if num_pairs <= 512 else 64


def align_pairs(
    ids: torch.Tensor, first: int, count: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [blocks x block_m]: pair ids grouped by local expert, each expert's run padded to
    whole blocks with the no-pair id T x k; block_expert [blocks]: each block's local expert or
    -1), for experts first..first+count-1 of this rank, sized for the worst case."""
    num_pairs = ids.numel()
    device = ids.device
    key = ids.reshape(-1) - first
    key = torch.where((key >= 0) & (key < count), key, count)  # another rank's: after all
    counts = count_per_expert(key, count + 1)
    padded = (counts + block_m - 1) // block_m * block_m
    padded[count] = 0  # other ranks' pairs take no block
    block_ends = torch.cumsum(padded, 0)
    order = torch.argsort(key, stable=True)
    run_starts = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    sorted_key = key.index_select(0, order)
    within = torch.arange(num_pairs, device=device) - run_starts.index_select(0, sorted_key)
    dest = (block_ends - padded).index_select(0, sorted_key) + within
    blocks = triton.cdiv(num_pairs + count * (block_m - 1), block_m)
    dump = blocks * block_m  # other ranks' pairs land past the end, then are cut off
    dest = torch.where(sorted_key < count, dest, dump)
    pairs = torch.full((dump + 1,), num_pairs, dtype=torch.int64, device=device)
    pairs.scatter_(0, dest, order)
    starts = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(block_ends[:count], starts, right=True)
    block_expert = torch.where(block_expert < count, block_expert, -1)
    return pairs[:dump], block_expert


def _launch(a, b, c, pairs, block_expert, weights, num_pairs, a_row_div, block_m) -> None:
    n, k = b.shape[1], b.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm[grid](
        a,
        b,
        c,
        pairs,
        block_expert,
        weights,
        num_pairs,
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        A_ROW_DIV=a_row_div,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first: int,
) -> torch.Tensor:
    """Sum over each token's routed experts among this rank's (global ids first..) of router
    weight x expert(token): [tokens, hidden], as FusedExperts' CPU path."""
    tokens, top_k = ids.shape
    count, columns = w13.shape[0], w13.shape[1] // 2
    num_pairs = tokens * top_k
    block_m = block_m_for(num_pairs)
    pairs, block_expert = align_pairs(ids, first, count, block_m)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    gate_up = x.new_empty(num_pairs, 2 * columns)
    _launch(x, w13, gate_up, pairs, block_expert, None, num_pairs, top_k, block_m)
    act = F.silu(gate_up[:, :columns]) * gate_up[:, columns:]
    down = x.new_zeros(num_pairs, x.shape[1])  # other ranks' pairs stay 0
    flat_weights = weights.reshape(-1).contiguous()
    _launch(act, w2, down, pairs, block_expert, flat_weights, num_pairs, 1, block_m)
    return down.view(tokens, top_k, x.shape[1]).sum(dim=1)
