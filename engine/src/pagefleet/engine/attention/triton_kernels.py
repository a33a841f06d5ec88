"""Triton kernels of the GPU attention backend: the KV-cache write through the slot mapping and
paged attention over block tables for a mixed batch, with an optional split-KV pass.

Layout per layer (as the torch reference): k_cache/v_cache [kv_heads, num_blocks, block_size,
head_dim]. A batch is flattened to sequences: sequence s owns query rows
query_start[s]:query_start[s+1] and attends to its first seq_lens[s] cached tokens, causally
(query row i of s sits at position seq_lens[s] - query_len + i). Each program of the attention
kernel takes BLOCK_Q query rows of one sequence for all query heads of one KV head (GQA), so a
KV tile is read once for its GROUP query heads. Split-KV (flash-decoding) adds a grid axis over
the context and a small reduction kernel; it pays when few programs would leave SMs idle.

An fp8 (e4m3) cache is stored as x / scale clamped to +-448 (the layer's k_scale or v_scale)
and read back as its value x scale: the key scale folds into the softmax scale and the value
scale into the output, so the inner loop only converts the loaded tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # the largest e4m3fn value


@dataclass(frozen=True)
class TileConfig:
    """Compile-time tile shape of one attention launch."""

    block_m: int  # query rows x query heads per program (BLOCK_Q * GROUP)
    block_q: int  # query positions per program
    tile_n: int  # keys per inner-loop iteration
    block_d: int  # head_dim rounded up to a power of two
    num_warps: int


def tile_config(group: int, head_dim: int, max_query_len: int) -> TileConfig:
    """Tiles for a launch: decode-only batches use the smallest tile tl.dot accepts (16 rows),
    batches with prompt chunks a 64-row tile so a chunk's keys are read fewer times."""
    rows = 16 if max_query_len <= 1 else 64
    block_m = max(rows, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Keep the [block_d, tile_n] key tile near 16 KiB in 16-bit types.
    tile_n = 32 if block_d > 128 else 64
    # Twice the warps once the fp32 accumulator passes 64 x 128 (registers, not spills).
    num_warps = 8 if block_m * block_d > 64 * 128 else 4
    return TileConfig(block_m, block_m // group, tile_n, block_d, num_warps)


def choose_num_splits(num_programs: int, max_context: int, num_sms: int) -> int:
    """How many context splits to run (flash-decoding): a power of two, 1 unless the grid would
    leave SMs idle and each split keeps at least 512 keys, so the merge stays cheap."""
    if num_programs <= 0 or max_context < 1024 or num_programs >= num_sms:
        return 1
    wanted = math.ceil(2 * num_sms / num_programs)  # two waves of programs
    by_length = max_context // 512
    splits = max(1, min(16, wanted, by_length))
    return 1 << (splits.bit_length() - 1)  # a power of two: the merge kernel's tl.arange


@triton.jit
def _reshape_and_cache_kernel(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cb,
    stride_ct,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_mapping + row).to(tl.int64)
    if slot >= 0:  # -1: the row's keys/values are already cached (or it is padding)
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        dest = heads * stride_ch + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + dims
        k = tl.load(key + row * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(value + row * stride_vt + heads * stride_vh + dims, mask=mask)
        if QUANTIZE:  # fp8: saturate, since e4m3fn turns out-of-range values into NaN
            k = tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
            v = tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
        tl.store(key_cache + dest, k.to(key_cache.dtype.element_ty), mask=mask)
        tl.store(value_cache + dest, v.to(value_cache.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip the row
    kv_scale: tuple[float, float] | None = None,  # an fp8 cache's (k_scale, v_scale)
) -> None:
    """Write each row's keys and values into its pool slot (block * block_size + offset),
    quantised with the layer's scales for an fp8 cache."""
    num_rows, num_kv_heads, head_dim = key.shape
    if num_rows == 0:
        return
    _check_cache_pair(key_cache, value_cache)
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _reshape_and_cache_kernel[(num_rows,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *(kv_scale or (1.0, 1.0)),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=key_cache.shape[2],
        QUANTIZE=kv_scale is not None,
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    part_out,
    part_lse,
    block_tables,
    seq_lens,
    query_start,
    work_seq,
    work_q,
    scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ch,
    stride_cb,
    stride_ct,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAGE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(work_seq + work)
    q_first = tl.load(work_q + work)
    q_begin = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - q_begin
    seq_len = tl.load(seq_lens + seq)
    prefix = seq_len - q_len  # tokens cached before this step's queries

    # Row m of the tile is query position q_first + m // GROUP, query head m % GROUP of the group.
    offs_m = tl.arange(0, BLOCK_M)
    q_off = q_first + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = q_off < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    token = (q_begin + q_off).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = prefix + q_off

    # Keys up to the tile's last query position; this split's share of them, tile-aligned.
    kv_len = tl.minimum(seq_len, prefix + q_first + BLOCK_Q)
    per_split = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), TILE_N) * TILE_N
    kv_lo = split * per_split
    kv_hi = tl.minimum(kv_len, kv_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    head_base = kv_head.to(tl.int64) * stride_ch
    for start in range(kv_lo, kv_hi, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        n_ok = offs_n < kv_hi
        page = tl.load(table + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        kv_off = head_base + page * stride_cb + (offs_n % PAGE) * stride_ct
        k = tl.load(
            k_cache + kv_off[None, :] + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead to avoid NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache + kv_off[:, None] + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale  # x 1.0 is exact
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        dest = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        part = token * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part_out + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        tl.store(part_lse + part, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out,
    part_lse,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    base = token * stride_pt + head * stride_ph + splits
    lse = tl.load(part_lse + base)
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(lse - top)  # 0 for splits that saw no key
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    parts = tl.load(part_out + base[:, None] * HEAD_DIM + offs_d[None, :], mask=d_ok[None, :])
    total = tl.sum(weight, 0)
    merged = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    dest = out_ptr + token * stride_ot + head * stride_oh + offs_d
    tl.store(dest, merged.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    key_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [seqs] int32
    query_start: torch.Tensor,  # [seqs + 1] int32
    work_seq: torch.Tensor,  # [programs] int32: the sequence of each program
    work_q: torch.Tensor,  # [programs] int32: its first query row within the sequence
    tiles: TileConfig,
    num_splits: int,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scale: tuple[float, float] | None = None,  # an fp8 cache's (k_scale, v_scale)
) -> torch.Tensor:
    """Attention of every query row over its sequence's paged keys and values."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[0]
    _check_cache_pair(key_cache, value_cache)
    q = _last_dim_contiguous(q)
    out = torch.empty_like(q) if out is None else out
    num_work = work_seq.shape[0]
    if num_tokens == 0 or num_work == 0:
        return out
    group = num_heads // num_kv_heads
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits={num_splits} must be a power of two")
    if num_splits > 1:
        # Scratch of the splits: each split's normalised output and log-sum-exp.
        part_lse = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
    else:
        part_lse = part_out = out  # unused by the kernel when NUM_SPLITS == 1
    _paged_attention_kernel[(num_work, num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        out,
        part_out,
        part_lse,
        block_tables,
        seq_lens,
        query_start,
        work_seq,
        work_q,
        # Stored keys are k / k_scale: q . k = (q . stored) x k_scale; likewise for values.
        scale * (kv_scale[0] if kv_scale else 1.0),
        kv_scale[1] if kv_scale else 1.0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        num_heads * num_splits,
        num_splits,
        1,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=tiles.block_d,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        PAGE=key_cache.shape[2],
        TILE_N=tiles.tile_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            part_out,
            part_lse,
            out.stride(0),
            out.stride(1),
            num_heads * num_splits,
            num_splits,
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=tiles.block_d,
        )
    return out


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    # The kernels address both caches with the key cache's strides.
    if key_cache.stride() != value_cache.stride() or key_cache.shape != value_cache.shape:
        raise ValueError("key and value caches must share shape and strides")
    if key_cache.stride(3) != 1:
        raise ValueError("the cache's head_dim must be contiguous")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
