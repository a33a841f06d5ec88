"""Paged decode attention on CPU that reads keys and values through the block table in place.

The torch reference backend gathers every decode row's blocks into one padded tensor before
its matmuls: a copy of all the keys and values each step. This backend's single-token rows go
through a numba-compiled kernel instead (numba's wheel bundles LLVM, so no compiler is needed
where it runs): one work item per (row, KV head), spread over threads with prange (or run on
the calling thread where there are too few to share: `runs_serially`); each item
walks the row's block table, reads each key/value block once for all the query heads of its
GQA group, and keeps an online softmax (running max, running sum, rescaled accumulator), so
nothing the size of the context is ever written. Prompt chunks, fp8 pools and dtypes the
kernel does not take stay on the torch path (`TorchAttentionBackend`, the oracle).

The kernel is compiled once per machine (numba's on-disk cache) and loaded when the backend
is built, at engine start, so no request pays for it.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba.core import types
from numba.extending import overload

from pagefleet.engine.attention.backend import NUMBA_KV_DTYPES, SingleGroup
from pagefleet.engine.attention.torch_ref import TorchAttentionBackend
from pagefleet.engine.kv_cache.fp8 import LayerScales

# Reassociation lets LLVM vectorise the dot products and the accumulator updates; no
# assumptions about infinities or NaNs (the running max starts at a finite floor anyway).
_FAST = {"reassoc", "contract", "nsz", "arcp"}
_FLOOR = np.float32(-1e30)  # below any real score: exp(_FLOOR - score) is exactly 0


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def _attend_group(q, keys, values, table, length, first, group, scale, out, widen_k, widen_v):
    """Attention of query heads first..first+group (q: [heads, d]) over one KV head's paged
    keys/values (keys, values: [blocks, block_size, d]) for `length` tokens, into out."""
    head_dim = q.shape[1]
    block_size = keys.shape[1]
    queries = np.empty((group, head_dim), np.float32)
    for g in range(group):
        for d in range(head_dim):
            queries[g, d] = np.float32(q[first + g, d]) * scale
    best = np.full(group, _FLOOR, np.float32)
    total = np.zeros(group, np.float32)
    acc = np.zeros((group, head_dim), np.float32)
    scores = np.empty(block_size, np.float32)
    for b in range((length + block_size - 1) // block_size):
        block = table[b]
        count = min(block_size, length - b * block_size)
        k_block = _as_f32(keys[block], widen_k)
        v_block = _as_f32(values[block], widen_v)
        for g in range(group):
            top = best[g]
            for t in range(count):
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += queries[g, d] * k_block[t, d]
                scores[t] = dot
                top = max(top, dot)
            fix = np.float32(math.exp(best[g] - top))
            best[g] = top
            total[g] *= fix
            for d in range(head_dim):
                acc[g, d] *= fix
            for t in range(count):
                p = np.float32(math.exp(scores[t] - top))
                total[g] += p
                for d in range(head_dim):
                    acc[g, d] += p * v_block[t, d]
    for g in range(group):
        inv = np.float32(1.0) / total[g]
        for d in range(head_dim):
            out[first + g, d] = acc[g, d] * inv


def _as_f32(block, widen):
    """A [block_size, d] pool block as float32 (compiled per pool dtype: see _as_f32_for)."""
    raise NotImplementedError("only called from compiled code")


def _float32_block(block, widen):
    return block


def _widened_bf16_block(block, widen):
    # bfloat16 is the high half of a float32: shift its bits (stored as uint16) up.
    bits = widen.view(np.uint32)
    for t in range(block.shape[0]):
        for d in range(block.shape[1]):
            bits[t, d] = np.uint32(block[t, d]) << np.uint32(16)
    return widen


@overload(_as_f32)
def _as_f32_for(block, widen):
    return _float32_block if block.dtype == types.float32 else _widened_bf16_block


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def _decode_item(q, k_cache, v_cache, tables, lens, scale, out, item):
    """Work item `item` = (row, KV head) of the kernels below."""
    num_kv = k_cache.shape[0]
    group = q.shape[1] // num_kv
    row = item // num_kv
    kv = item - row * num_kv
    widen_k = np.empty((k_cache.shape[2], k_cache.shape[3]), np.float32)
    widen_v = np.empty((k_cache.shape[2], k_cache.shape[3]), np.float32)
    _attend_group(
        q[row],
        k_cache[kv],
        v_cache[kv],
        tables[row],
        lens[row],
        kv * group,
        group,
        scale,
        out[row],
        widen_k,
        widen_v,
    )


@numba.njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def paged_decode(q, k_cache, v_cache, tables, lens, scale, out):
    """out[r] = softmax(q[r] . K_r^T * scale) V_r for single-token rows r, where K_r/V_r are
    the first lens[r] tokens of the blocks tables[r] in k_cache/v_cache
    ([kv_heads, blocks, block_size, d]). q/out: [rows, heads, d] float32; the pool is float32
    or bfloat16 viewed as uint16. One work item per (row, KV head), over numba's threads."""
    for item in numba.prange(q.shape[0] * k_cache.shape[0]):
        _decode_item(q, k_cache, v_cache, tables, lens, scale, out, item)


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def paged_decode_serial(q, k_cache, v_cache, tables, lens, scale, out):
    """paged_decode on the calling thread alone."""
    for item in range(q.shape[0] * k_cache.shape[0]):
        _decode_item(q, k_cache, v_cache, tables, lens, scale, out, item)


def runs_serially(rows: int, num_kv_heads: int, threads: int) -> bool:
    """Whether a step's decode rows run on the calling thread: with fewer than two work items
    per thread (single-stream decode of a model with few KV heads) the threads cannot share
    the work evenly, and a parallel launch would only add its start and its barrier."""
    return rows * num_kv_heads < 2 * threads


def decode_attention(
    q: torch.Tensor,  # [rows, heads, d]
    k_cache: torch.Tensor,  # [kv_heads, blocks, block_size, d]
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [rows, >= max blocks] int64
    lens: torch.Tensor,  # [rows] int64
    scale: float,
    serial: bool | None = None,
) -> torch.Tensor:
    """The kernel on torch tensors (shared memory, no copies of the pool); float32 out, cast
    back to q's dtype. `serial` None: as runs_serially says."""
    out = torch.empty(q.shape, dtype=torch.float32)
    if serial is None:
        serial = runs_serially(q.shape[0], k_cache.shape[0], numba.get_num_threads())
    (paged_decode_serial if serial else paged_decode)(
        q.float().contiguous().numpy(),
        _pool_array(k_cache),
        _pool_array(v_cache),
        tables.contiguous().numpy(),
        lens.contiguous().numpy(),
        np.float32(scale),
        out.numpy(),
    )
    return out.to(q.dtype)


def _pool_array(cache: torch.Tensor) -> np.ndarray:
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.uint16).numpy()
    return cache.numpy()


def kernel_takes(q: torch.Tensor, k_cache: torch.Tensor, kv_scale: LayerScales | None) -> bool:
    """Whether the kernel covers this layer: a CPU pool of float32 or bfloat16 (fp8 pools and
    float16 stay on the torch path), contiguous as the pool allocates it."""
    return (
        kv_scale is None
        and q.device.type == "cpu"
        and k_cache.dtype in NUMBA_KV_DTYPES
        and k_cache.is_contiguous()
    )


def warm_up(pool_dtypes: tuple[torch.dtype, ...] = NUMBA_KV_DTYPES) -> None:
    """Compile (or load from numba's cache) both kernels for pools of `pool_dtypes`, on a tiny
    batch: at engine start, not in the first request (each takes a second or more to compile
    where numba's cache is cold, as in a fresh pod)."""
    tables = torch.zeros(1, 1, dtype=torch.int64)
    lens = torch.ones(1, dtype=torch.int64)
    q = torch.zeros(1, 2, 4)
    for dtype in pool_dtypes:
        cache = torch.zeros(1, 1, 2, 4, dtype=dtype)
        for serial in (True, False):
            decode_attention(q, cache, cache, tables, lens, 1.0, serial)


def group_lens(group: SingleGroup) -> torch.Tensor:
    """Context length of each row of a group: given by the runner (and carried to TP workers
    by the step codec); read off the mask only for a group built without them."""
    if group.seq_lens is not None:
        return group.seq_lens
    return group.mask.view(group.end - group.start, -1).sum(1)


class NumbaAttentionBackend(TorchAttentionBackend):
    """The torch backend with its decode rows on the in-place paged kernel."""

    name = "numba"

    def __init__(self, kv_dtype: torch.dtype | None = None) -> None:
        """`kv_dtype`: the pool's, the only one compiled now (None: every one it reads)."""
        warm_up((kv_dtype,) if kv_dtype in NUMBA_KV_DTYPES else NUMBA_KV_DTYPES)

    def _single(
        self, q, k_cache, v_cache, group: SingleGroup, scale: float, kv_scale: LayerScales | None
    ):
        if not kernel_takes(q, k_cache, kv_scale):
            return super()._single(q, k_cache, v_cache, group, scale, kv_scale)
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        return decode_attention(q, k_cache, v_cache, group.block_tables, group_lens(group), scale)
