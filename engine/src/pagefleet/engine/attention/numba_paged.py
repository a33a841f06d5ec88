"""Paged decode attention on CPU that reads keys and values through the block table in place.

The torch reference backend gathers every decode row's blocks into one padded tensor before
its matmuls: a copy of all the keys and values each step. This backend's single-token rows go
through a numba-compiled kernel instead (numba's wheel bundles LLVM, so no compiler is needed
where it runs): one work item per (row, KV head), spread over threads with prange; each item
walks the row's block table, reads each key/value block once for all the query heads of its
GQA group, and keeps an online softmax (running max, running sum, rescaled accumulator), so
nothing the size of the context is ever written. It prefetches the next block while it
computes one (a table's blocks are scattered pages). A step with too few items to give each
thread two (single-stream decode) cuts each context into runs of blocks, one item each,
merged afterwards (`context_parts`), or runs on the calling thread where there is nothing to
cut (`runs_serially`). Prompt chunks, fp8 pools and dtypes the
kernel does not take stay on the torch path (`TorchAttentionBackend`, the oracle).

The kernel is compiled once per machine (numba's on-disk cache) and loaded when the backend
is built, at engine start, so no request pays for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from pagefleet.engine.attention.backend import NUMBA_KV_DTYPES, SingleGroup
from pagefleet.engine.attention.torch_ref import TorchAttentionBackend
from pagefleet.engine.kernel_cache import match_torch_threads, use_image_kernels
from pagefleet.engine.kv_cache.fp8 import LayerScales

use_image_kernels()  # before the kernels below are defined (and loaded or compiled)

# Reassociation lets LLVM vectorise the dot products and the accumulator updates; no
# assumptions about infinities or NaNs (the running max starts at a finite floor anyway).
_FAST = {"reassoc", "contract", "nsz", "arcp"}
_FLOOR = np.float32(-1e30)  # below any real score: exp(_FLOOR - score) is exactly 0
_LINE_BYTES = 64


@intrinsic
def prefetch(typingctx, array, index):
    """A hint that array.flat[index]'s cache line will be read soon (LLVM's prefetch: never
    faults, whatever the address)."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [data.type, i32, i32, i32])
        prefetch = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read (0), keep in every cache level (3), data (1)
        flags = [ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)]
        builder.call(prefetch, [builder.gep(data, [args[1]]), *flags])
        return context.get_dummy_value()

    return types.void(array, index), codegen


@numba.njit(inline="always")
def _prefetch_rows(flat, block, rows, block_size, head_dim):
    """Prefetch tokens `rows` of `block` in a flattened [blocks, block_size, d] pool, line by
    line: the blocks of a table are scattered pages, which the hardware prefetcher does not
    follow. The attention asks for the next block's rows a few at a time as it computes the
    current one: a whole block's lines asked for at once fill the core's miss buffers and
    stall it (1.13x the kernel's throughput on an Intel Xeon)."""
    step = _LINE_BYTES // flat.itemsize
    for t in rows:
        first = (block * block_size + t) * head_dim
        for i in range(first, first + head_dim, step):
            prefetch(flat, i)


# exp(x) for x <= 0 as exp(r) * 2**k, x = k ln2 + r, |r| <= ln2 / 2: a degree-6 polynomial
# (Cephes' expf; within 3 ulp of float32 exp) that LLVM vectorises, where math.exp is a scalar
# libm call per score (llvmlite is built without a vector math library).
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_POLY = tuple(
    np.float32(c)
    for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1)
)
_EXP_MIN = np.float32(-80.0)  # exp(-80) ~ 2e-35: a weight of 0 beside the row's max's 1


@numba.njit(fastmath=_FAST, inline="always")
def _exp_shifted(scores, shift, count, out):
    """out[i] = exp(scores[i] - shift) for i < count, every scores[i] <= shift."""
    bits = out.view(np.int32)
    c0, c1, c2, c3, c4 = _EXP_POLY
    for i in range(count):
        x = max(scores[i] - shift, _EXP_MIN)
        k = np.floor(x * _LOG2E + np.float32(0.5))
        r = x - k * _LN2_HI - k * _LN2_LO
        y = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + np.float32(0.5)
        out[i] = y * r * r + r + np.float32(1.0)
        bits[i] += np.int32(k) << np.int32(23)  # times 2**k: k added to the exponent


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def _attend_blocks(q, k_cache, v_cache, tables, lens, row, kv, start, end, scale, state):
    """Attention of row `row`'s query heads of KV head `kv`'s GQA group (q: [rows, heads, d])
    over blocks start..end of the row's paged keys/values (pools: [kv_heads, blocks,
    block_size, d]), folded into `state` (best, total, acc: the running max, the sum of
    exponentials and the unnormalised output of each query head of the group).

    Each block: every key row read once for all the group's heads (their scores), then per
    head a max, the exponentials, and the values summed into its output."""
    best, total, acc = state
    group = q.shape[1] // k_cache.shape[0]
    first = kv * group
    q, keys, values = q[row], k_cache[kv], v_cache[kv]
    table, length = tables[row], lens[row]
    head_dim = q.shape[1]
    block_size = keys.shape[1]
    queries = np.empty((group, head_dim), np.float32)
    for g in range(group):
        for d in range(head_dim):
            queries[g, d] = np.float32(q[first + g, d]) * scale
    scores = np.empty((group, block_size), np.float32)
    weights = np.empty(block_size, np.float32)
    # Room for a bfloat16 block widened to float32; a float32 pool's blocks are read in place.
    widened = block_size if keys.itemsize == 2 else 0
    widen_k = np.empty((widened, head_dim), np.float32)
    widen_v = np.empty((widened, head_dim), np.float32)
    k_flat, v_flat = keys.reshape(-1), values.reshape(-1)
    if start < end:
        _prefetch_rows(k_flat, table[start], range(block_size), block_size, head_dim)
        _prefetch_rows(v_flat, table[start], range(block_size), block_size, head_dim)
    for b in range(start, end):
        upcoming = table[b + 1] if b + 1 < end else -1
        count = min(block_size, length - b * block_size)
        k_block = _as_f32(keys[table[b]], widen_k)
        for t in range(count):
            if upcoming >= 0:  # the next block's keys arrive while this one's are scored
                _prefetch_rows(k_flat, upcoming, range(t, t + 1), block_size, head_dim)
            key = k_block[t]
            for g in range(group):
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += queries[g, d] * key[d]
                scores[g, t] = dot
        if upcoming >= 0:
            _prefetch_rows(k_flat, upcoming, range(count, block_size), block_size, head_dim)
        v_block = _as_f32(values[table[b]], widen_v)
        # Each head of the group in turn (written out here, not in a helper: numba's inlined
        # helper left these loops 1.1x slower): its block max, the rescale where the max rose,
        # the exponentials and their sum, then the values four rows at a time.
        for g in range(group):
            if upcoming >= 0:  # ... and the next block's values while these are summed
                rows = range(g, block_size, group)
                _prefetch_rows(v_flat, upcoming, rows, block_size, head_dim)
            head_scores, out = scores[g], acc[g]
            top = best[g]
            for t in range(count):
                top = max(top, head_scores[t])
            if top > best[g]:
                fix = np.float32(math.exp(best[g] - top))
                best[g] = top
                total[g] *= fix
                for d in range(head_dim):
                    out[d] *= fix
            _exp_shifted(head_scores, top, count, weights)
            block_sum = np.float32(0.0)
            for t in range(count):
                block_sum += weights[t]
            total[g] += block_sum
            t = 0
            while t + 4 <= count:  # a quarter of the accumulator's loads and stores
                p0, p1, p2, p3 = weights[t], weights[t + 1], weights[t + 2], weights[t + 3]
                v0, v1, v2, v3 = v_block[t], v_block[t + 1], v_block[t + 2], v_block[t + 3]
                for d in range(head_dim):
                    out[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
                t += 4
            while t < count:
                p, v = weights[t], v_block[t]
                for d in range(head_dim):
                    out[d] += p * v[d]
                t += 1


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
def _piece_states(q, num_kv, parts):
    """Running max, sum and output of every (row, KV head, run) work item, fresh."""
    group = q.shape[1] // num_kv
    pieces = q.shape[0] * num_kv * parts
    return (
        np.full((pieces, group), _FLOOR, np.float32),
        np.zeros((pieces, group), np.float32),
        np.zeros((pieces, group, q.shape[2]), np.float32),
    )


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def _decode_piece(q, k_cache, v_cache, tables, lens, scale, out, parts, states, piece):
    """Work item `piece` = (row, KV head, run) of the kernels below. An item with its whole
    context (one run) writes its output; runs wait for `_merge_runs`."""
    best, total, acc = states
    num_kv, block_size = k_cache.shape[0], k_cache.shape[2]
    group = q.shape[1] // num_kv
    item, part = piece // parts, piece % parts
    row, kv = item // num_kv, item % num_kv
    blocks = (lens[row] + block_size - 1) // block_size
    per = (blocks + parts - 1) // parts
    start, end = min(blocks, part * per), min(blocks, (part + 1) * per)
    state = (best[piece], total[piece], acc[piece])
    _attend_blocks(q, k_cache, v_cache, tables, lens, row, kv, start, end, scale, state)
    if parts == 1:
        for g in range(group):
            inv = np.float32(1.0) / total[piece, g]
            for d in range(q.shape[2]):
                out[row, kv * group + g, d] = acc[piece, g, d] * inv


@numba.njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def paged_decode(q, k_cache, v_cache, tables, lens, scale, out, parts):
    """out[r] = softmax(q[r] . K_r^T * scale) V_r for single-token rows r, where K_r/V_r are
    the first lens[r] tokens of the blocks tables[r] in k_cache/v_cache
    ([kv_heads, blocks, block_size, d]). q/out: [rows, heads, d] float32; the pool is float32
    or bfloat16 viewed as uint16. One work item per (row, KV head) and run of blocks (each
    context cut into `parts` runs; their partial maxima, sums and outputs merged afterwards),
    over numba's threads."""
    states = _piece_states(q, k_cache.shape[0], parts)
    for piece in numba.prange(q.shape[0] * k_cache.shape[0] * parts):
        _decode_piece(q, k_cache, v_cache, tables, lens, scale, out, parts, states, piece)
    if parts > 1:
        _merge_runs(*states, parts, out)


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def paged_decode_serial(q, k_cache, v_cache, tables, lens, scale, out, parts):
    """paged_decode on the calling thread alone (a parallel launch on one thread costs more
    in a step than the work of a one-stream decode at a short context)."""
    states = _piece_states(q, k_cache.shape[0], parts)
    for piece in range(q.shape[0] * k_cache.shape[0] * parts):
        _decode_piece(q, k_cache, v_cache, tables, lens, scale, out, parts, states, piece)
    if parts > 1:
        _merge_runs(*states, parts, out)


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def _merge_runs(best, total, acc, parts, out):
    """out[row, head] from the runs of each (row, KV head): each run's sum and output rescaled
    to the largest running max (a run with no blocks weighs exactly 0)."""
    group, head_dim = best.shape[1], acc.shape[2]
    num_kv = out.shape[1] // group
    for item in range(best.shape[0] // parts):
        row, kv = item // num_kv, item % num_kv
        first = item * parts
        for g in range(group):
            top = _FLOOR
            for p in range(first, first + parts):
                top = max(top, best[p, g])
            merged = out[row, kv * group + g]  # summed in place: no buffer per head
            merged[:] = 0.0
            denominator = np.float32(0.0)
            for p in range(first, first + parts):
                weight = np.float32(math.exp(best[p, g] - top))
                denominator += weight * total[p, g]
                for d in range(head_dim):
                    merged[d] += weight * acc[p, g, d]
            inv = np.float32(1.0) / denominator
            for d in range(head_dim):
                merged[d] *= inv


# A run shorter than this many blocks is not worth a thread of its own: at a short context
# the parallel launch and the merge cost more than the second thread's reads gain (one stream
# of SmolLM2 at 100-170 tokens ran 2-3% slower cut in two).
MIN_RUN_BLOCKS = 16


def context_parts(rows: int, num_kv_heads: int, threads: int, blocks: int) -> int:
    """How many runs of blocks each (row, KV head) work item is cut into: 1 where the items
    already give each thread two (or there is one thread); otherwise enough runs that they do,
    each at least MIN_RUN_BLOCKS of the longest context's `blocks`. 1 with too few items to
    share means `runs_serially`."""
    items = rows * num_kv_heads
    if threads < 2 or items >= 2 * threads:
        return 1
    return max(1, min(blocks // MIN_RUN_BLOCKS, -(-2 * threads // items)))


def runs_serially(rows: int, num_kv_heads: int, threads: int) -> bool:
    """Whether a step's decode rows run on the calling thread: with fewer than two work items
    per thread (single-stream decode of a model with few KV heads) a parallel launch would
    only add its start and its barrier. Asked only where `context_parts` cut nothing."""
    return rows * num_kv_heads < 2 * threads


@dataclass(frozen=True)
class KernelPlan:
    """What every layer's kernel call of one step shares: the rows' block tables and context
    lengths as arrays, and how the contexts run (`context_parts`, `runs_serially`)."""

    tables: np.ndarray  # [rows, >= max blocks] int64
    lens: np.ndarray  # [rows] int64
    parts: int
    serial: bool


def plan_kernel(
    tables: torch.Tensor,
    lens: torch.Tensor,
    num_kv_heads: int,
    serial: bool | None = None,
    parts: int | None = None,
) -> KernelPlan:
    """`parts` None: as context_parts says; `serial` None: on the calling thread where the
    context is not cut and runs_serially says so."""
    threads = numba.get_num_threads()
    if parts is None:
        parts = context_parts(len(lens), num_kv_heads, threads, tables.shape[1])
    if serial is None:
        serial = parts == 1 and runs_serially(len(lens), num_kv_heads, threads)
    return KernelPlan(tables.contiguous().numpy(), lens.contiguous().numpy(), parts, serial)


def run_kernel(
    q: torch.Tensor,  # [rows, heads, d]
    k_cache: torch.Tensor,  # [kv_heads, blocks, block_size, d]
    v_cache: torch.Tensor,
    plan: KernelPlan,
    scale: float,
) -> torch.Tensor:
    """The kernel on torch tensors (shared memory, no copies of the pool); float32 out, cast
    back to q's dtype."""
    out = np.empty(q.shape, np.float32)
    kernel = paged_decode_serial if plan.serial else paged_decode
    pools = _pool_array(k_cache), _pool_array(v_cache)
    kernel(
        q.float().contiguous().numpy(),
        *pools,
        plan.tables,
        plan.lens,
        np.float32(scale),
        out,
        plan.parts,
    )
    return torch.from_numpy(out).to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    serial: bool | None = None,
    parts: int | None = None,
) -> torch.Tensor:
    """One call of the kernel, planned for itself (see plan_kernel and run_kernel)."""
    plan = plan_kernel(tables, lens, k_cache.shape[0], serial, parts)
    return run_kernel(q, k_cache, v_cache, plan, scale)


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
    batch: at engine start, not in the first request (each takes seconds to compile where
    numba's cache is cold, as in a fresh pod)."""
    tables = torch.zeros(1, 1, dtype=torch.int64)
    lens = torch.ones(1, dtype=torch.int64)
    q = torch.zeros(1, 2, 4)
    for dtype in pool_dtypes:
        cache = torch.zeros(1, 1, 2, 4, dtype=dtype)
        for serial in (True, False):
            decode_attention(q, cache, cache, tables, lens, 1.0, serial, parts=1)


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
        num_kv = k_cache.shape[0]
        plan = group.plans.get(num_kv)
        if plan is None:  # the step's first layer: every other one reuses it
            match_torch_threads()
            plan = group.plans[num_kv] = plan_kernel(group.block_tables, group_lens(group), num_kv)
        return run_kernel(q, k_cache, v_cache, plan, scale)
