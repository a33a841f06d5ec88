"""Triton kernels for linear attention on GPU: the short causal convolution (decode update,
prompt chunks, and the per-sequence last inputs it keeps) and the gated delta rule (one token
of many sequences, and prompt chunks in the chunked form). Tested against torch_ops.py in
Triton's interpreter (tests/triton_interpret_cases.py); timed only on a GPU.

Chunked delta rule, in two launches per layer. `_chunk_prep` takes one chunk of BT tokens
of one head (BT 64, or 16/32 when every prompt chunk of the step is that short): it normalises
the keys, forms A = strictly-lower(beta_i exp(G_i - G_j) k_i.k_j), inverts (I + A) by forward
substitution on the BT x BT tile, and writes the chunk's W = (I + A)^-1 (beta exp(G) k) and
U = (I + A)^-1 (beta v) and its cumulative log decay G. `_chunk_scan` walks one sequence's
chunks in order for one head and a slice of the value dim, carrying the state S in registers:
u = U - W S, o = exp(G) q S + causal(q k^T exp(G_i - G_j)) u, S = exp(G_last) S +
(exp(G_last - G) k)^T u (torch_ops.chunked's algebra). A snapshot inside a prompt chunk starts
a new run of chunks there, and the scan stores S after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.engine.linear_attn.kernels import segments
from pagefleet.engine.linear_attn.state import StepStates, single_row_index

BT = 64  # most tokens per chunk of the chunked rule (as torch_ops.CHUNK)
EPS = 1e-6  # l2norm's, as the reference


# ---------------------------------------------------------------------------- convolution


@triton.jit
def _conv_update(
    x, weight, state, slots, rows, out,
    C, stride_xt, stride_ss, stride_sc,
    W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """One token of sequence b (row rows[b]): SiLU(sum of the last W inputs and x, weighted),
    and the last W inputs shifted by one (in place: each program owns its slot's channels)."""
    b = tl.program_id(0)
    row = tl.load(rows + b)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    j = tl.arange(0, BLOCK_W)
    jm = j < W
    slot = tl.load(slots + b)
    base = state + slot * stride_ss + c[:, None] * stride_sc
    old = tl.load(base + j[None, :], mask=cm[:, None] & jm[None, :], other=0.0).to(tl.float32)
    xv = tl.load(x + row * stride_xt + c, mask=cm, other=0.0).to(tl.float32)
    w_old = tl.load(weight + c[:, None] * (W + 1) + j[None, :], mask=cm[:, None] & jm[None, :])
    w_new = tl.load(weight + c * (W + 1) + W, mask=cm)
    acc = tl.sum(old * w_old.to(tl.float32), 1) + xv * w_new.to(tl.float32)
    tl.store(out + row * stride_xt + c, (acc * tl.sigmoid(acc)).to(out.dtype.element_ty), mask=cm)
    shifted = tl.load(base + j[None, :] + 1, mask=cm[:, None] & (j[None, :] + 1 < W), other=0.0)
    new = tl.where(j[None, :] == W - 1, xv[:, None], shifted.to(tl.float32))
    tl.store(base + j[None, :], new.to(state.dtype.element_ty), mask=cm[:, None] & jm[None, :])


@triton.jit
def _conv_input(x, state, start, slot, i, c, ok, stride_xt, stride_ss, stride_sc, W):
    """Inputs at chunk-relative indices i (< 0: the slot's last inputs before the chunk)."""
    from_x = tl.load(x + (start + i) * stride_xt + c, mask=ok & (i >= 0), other=0.0)
    from_state = tl.load(
        state + slot * stride_ss + c * stride_sc + (W + i), mask=ok & (i < 0), other=0.0
    )
    return from_x.to(tl.float32) + from_state.to(tl.float32)


@triton.jit
def _conv_chunk(
    x, weight, state, out, chunk_start, chunk_len, chunk_slot,
    C, stride_xt, stride_ss, stride_sc,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Outputs of BLOCK_T tokens x BLOCK_C channels of one prompt chunk (reads, never writes,
    the slot: `_conv_state` moves it on after every chunk's outputs are done)."""
    chunk = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    start = tl.load(chunk_start + chunk)
    n = tl.load(chunk_len + chunk)
    slot = tl.load(chunk_slot + chunk)
    ok = (t[:, None] < n) & (c[None, :] < C)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for tap in tl.static_range(W + 1):  # tap `tap` weighs the input W - tap tokens back
        i = t[:, None] - W + tap
        inputs = _conv_input(
            x, state, start, slot, i, c[None, :], ok, stride_xt, stride_ss, stride_sc, W
        )
        w = tl.load(weight + c * (W + 1) + tap, mask=c < C, other=0.0).to(tl.float32)
        acc += inputs * w[None, :]
    rows = (start + t[:, None]) * stride_xt + c[None, :]
    tl.store(out + rows, (acc * tl.sigmoid(acc)).to(out.dtype.element_ty), mask=ok)


@triton.jit
def _conv_state(
    x, state, chunk_start, chunk_len, chunk_slot, save_ptr, save_offset, save_dst,
    C, stride_xt, stride_ss, stride_sc,
    W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """A prompt chunk's last W inputs at each snapshot offset (into its destination slot),
    then at its end (into its own slot, last: the snapshots read its old inputs)."""
    chunk = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_W)
    start = tl.load(chunk_start + chunk)
    n = tl.load(chunk_len + chunk)
    slot = tl.load(chunk_slot + chunk)
    first = tl.load(save_ptr + chunk)
    last = tl.load(save_ptr + chunk + 1)
    ok = (c[:, None] < C) & (j[None, :] < W)
    for s in range(first, last + 1):
        is_save = s < last
        offset = tl.where(is_save, tl.load(save_offset + s, mask=is_save, other=0), n)
        dst = tl.where(is_save, tl.load(save_dst + s, mask=is_save, other=0), slot)
        i = offset - W + j[None, :]
        inputs = _conv_input(
            x, state, start, slot, i, c[:, None], ok, stride_xt, stride_ss, stride_sc, W
        )
        target = state + dst * stride_ss + c[:, None] * stride_sc + j[None, :]
        tl.store(target, inputs.to(state.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------- delta rule


@triton.jit
def _load_qk(ptr, row, head, stride_t, stride_h, kk, km, eps):
    """One token's l2-normalised query or key head, float32."""
    x = tl.load(ptr + row * stride_t + head * stride_h + kk, mask=km, other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, 0) + eps)


@triton.jit
def _recurrent(
    q, k, v, g, beta, ssm, slots, rows, out,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt,
    stride_ss, stride_sh, stride_sk,
    REPEAT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, scale, eps,
):  # fmt: skip
    """One token of sequence b (row rows[b]), value head h, BLOCK_V value columns: decay the
    state, write beta (v - S^T k) along k, read it with q (in place: the program owns those
    columns)."""
    b = tl.program_id(0)
    row = tl.load(rows + b)
    h = tl.program_id(1)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kk = tl.arange(0, BLOCK_K)
    km, vm = kk < DK, vv < DV
    kh = h // REPEAT
    qv = _load_qk(q, row, kh, stride_qt, stride_qh, kk, km, eps) * scale
    kv = _load_qk(k, row, kh, stride_qt, stride_qh, kk, km, eps)
    val = tl.load(v + row * stride_vt + h * stride_vh + vv, mask=vm, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g + row * stride_gt + h))
    strength = tl.load(beta + row * stride_gt + h).to(tl.float32)
    slot = tl.load(slots + b)
    cell = ssm + slot * stride_ss + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    mask = km[:, None] & vm[None, :]
    s = tl.load(cell, mask=mask, other=0.0).to(tl.float32) * decay
    update = (val - tl.sum(s * kv[:, None], 0)) * strength
    s += kv[:, None] * update[None, :]
    o = tl.sum(s * qv[:, None], 0)
    tl.store(out + row * stride_vt + h * stride_vh + vv, o.to(out.dtype.element_ty), mask=vm)
    tl.store(cell, s.to(ssm.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_prep(
    k, v, g, beta, w_out, u_out, g_out, chunk_start, chunk_len,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
    stride_wt, stride_wh, stride_ut, stride_uh,
    REPEAT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, eps,
):  # fmt: skip
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(chunk_start + chunk)
    n = tl.load(chunk_len + chunk)
    t = tl.arange(0, BT)
    tm = t < n
    kk = tl.arange(0, BLOCK_K)
    vv = tl.arange(0, BLOCK_V)
    rows = start + t
    key = tl.load(
        k + rows[:, None] * stride_kt + (h // REPEAT) * stride_kh + kk[None, :],
        mask=tm[:, None] & (kk[None, :] < DK),
        other=0.0,
    ).to(tl.float32)
    key = key * tl.rsqrt(tl.sum(key * key, 1) + eps)[:, None]
    val = tl.load(
        v + rows[:, None] * stride_vt + h * stride_vh + vv[None, :],
        mask=tm[:, None] & (vv[None, :] < DV),
        other=0.0,
    ).to(tl.float32)
    strength = tl.load(beta + rows * stride_gt + h, mask=tm, other=0.0).to(tl.float32)
    cum = tl.cumsum(tl.load(g + rows * stride_gt + h, mask=tm, other=0.0), 0)
    lower = t[:, None] > t[None, :]
    gap = tl.where(lower, cum[:, None] - cum[None, :], 0.0)
    k_beta = key * strength[:, None]
    a = tl.where(lower, tl.dot(k_beta, tl.trans(key), input_precision="ieee") * tl.exp(gap), 0.0)
    # (I + A)^-1 row by row: row i = e_i - sum_{j<i} A[i, j] row j (rows j < i are final).
    inverse = tl.where(t[:, None] == t[None, :], 1.0, 0.0)
    for i in range(1, BT):
        a_row = tl.sum(tl.where(t[:, None] == i, a, 0.0), 0)
        row = tl.where(t == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, 0)
        inverse = tl.where(t[:, None] == i, row[None, :], inverse)
    w = tl.dot(inverse, k_beta * tl.exp(cum)[:, None], input_precision="ieee")
    u = tl.dot(inverse, val * strength[:, None], input_precision="ieee")
    tl.store(
        w_out + rows[:, None] * stride_wt + h * stride_wh + kk[None, :],
        w,
        mask=tm[:, None] & (kk[None, :] < DK),
    )
    tl.store(
        u_out + rows[:, None] * stride_ut + h * stride_uh + vv[None, :],
        u,
        mask=tm[:, None] & (vv[None, :] < DV),
    )
    tl.store(g_out + rows * stride_gt + h, cum, mask=tm)


@triton.jit
def _chunk_scan(
    q, k, w_in, u_in, g_in, ssm, out,
    seq_slot, seq_first, chunk_start, chunk_len, chunk_dst,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt,
    stride_wt, stride_wh, stride_ut, stride_uh,
    stride_ss, stride_sh, stride_sk,
    REPEAT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, scale, eps,
):  # fmt: skip
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kk = tl.arange(0, BLOCK_K)
    t = tl.arange(0, BT)
    km, vm = kk < DK, vv < DV
    kh = h // REPEAT
    slot = tl.load(seq_slot + seq)
    cells = kk[:, None] * stride_sk + vv[None, :]
    mask = km[:, None] & vm[None, :]
    s = tl.load(ssm + slot * stride_ss + h * stride_sh + cells, mask=mask, other=0.0)
    s = s.to(tl.float32)
    for chunk in range(tl.load(seq_first + seq), tl.load(seq_first + seq + 1)):
        start = tl.load(chunk_start + chunk)
        n = tl.load(chunk_len + chunk)
        tm = t < n
        rows = start + t
        qk_mask = tm[:, None] & km[None, :]
        query = tl.load(
            q + rows[:, None] * stride_qt + kh * stride_qh + kk[None, :], mask=qk_mask, other=0.0
        ).to(tl.float32)
        query = query * tl.rsqrt(tl.sum(query * query, 1) + eps)[:, None] * scale
        key = tl.load(
            k + rows[:, None] * stride_qt + kh * stride_qh + kk[None, :], mask=qk_mask, other=0.0
        ).to(tl.float32)
        key = key * tl.rsqrt(tl.sum(key * key, 1) + eps)[:, None]
        cum = tl.load(g_in + rows * stride_gt + h, mask=tm, other=0.0)
        last = tl.sum(tl.where(t == n - 1, cum, 0.0), 0)
        w = tl.load(
            w_in + rows[:, None] * stride_wt + h * stride_wh + kk[None, :], mask=qk_mask, other=0.0
        )
        u = tl.load(
            u_in + rows[:, None] * stride_ut + h * stride_uh + vv[None, :],
            mask=tm[:, None] & vm[None, :],
            other=0.0,
        )
        u = u - tl.dot(w, s, input_precision="ieee")
        causal = t[:, None] >= t[None, :]
        gap = tl.where(causal, cum[:, None] - cum[None, :], 0.0)
        scores = tl.dot(query, tl.trans(key), input_precision="ieee")
        scores = tl.where(causal & tm[:, None], scores * tl.exp(gap), 0.0)
        o = tl.dot(query * tl.exp(cum)[:, None], s, input_precision="ieee")
        o += tl.dot(scores, u, input_precision="ieee")
        tl.store(
            out + rows[:, None] * stride_vt + h * stride_vh + vv[None, :],
            o.to(out.dtype.element_ty),
            mask=tm[:, None] & vm[None, :],
        )
        to_end = tl.where(tm, tl.exp(last - cum), 0.0)
        s = s * tl.exp(last) + tl.dot(tl.trans(key * to_end[:, None]), u, input_precision="ieee")
        dst = tl.load(chunk_dst + chunk) + tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.int64)
        snapshot = ssm + dst * stride_ss + h * stride_sh + cells
        tl.store(snapshot, s.to(ssm.dtype.element_ty), mask=mask & (dst >= 0))
    tl.store(ssm + slot * stride_ss + h * stride_sh + cells, s.to(ssm.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------- launches


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _chunk_tables(states: StepStates, device: torch.device) -> dict:
    """Per step, shared by every layer: the conv's chunks and snapshots, and the delta rule's
    BT-token pieces (a snapshot offset starts a new piece) per sequence."""
    tables = states.scratch.get("triton")
    if tables is not None:
        return tables
    longest = max((end - first for c in states.chunks for first, end, _ in segments(c)), default=1)
    bt = min(BT, max(16, triton.next_power_of_2(longest)))  # short chunks: smaller tiles
    save_ptr, save_offset, save_dst = [0], [], []
    piece_start, piece_len, piece_dst, seq_first = [], [], [], [0]
    for chunk in states.chunks:
        save_offset += [o for o, _ in chunk.saves]
        save_dst += [d for _, d in chunk.saves]
        save_ptr.append(len(save_offset))
        for first, end, dst in segments(chunk):
            for at in range(first, end, bt):
                piece_start.append(chunk.start + at)
                piece_len.append(min(bt, end - at))
                piece_dst.append(dst if at + bt >= end and dst is not None else -1)
        seq_first.append(len(piece_start))

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values or [0], dtype=torch.int64, device=device)

    tables = {
        "start": ints([c.start for c in states.chunks]),
        "len": ints([c.num_tokens for c in states.chunks]),
        "slot": ints([c.slot for c in states.chunks]),
        "save_ptr": ints(save_ptr),
        "save_offset": ints(save_offset),
        "save_dst": ints(save_dst),
        "piece_start": ints(piece_start),
        "piece_len": ints(piece_len),
        "piece_dst": ints(piece_dst),
        "seq_first": ints(seq_first),
        "max_len": max((c.num_tokens for c in states.chunks), default=0),
        "pieces": len(piece_start),
        "bt": bt,
    }
    states.scratch["triton"] = tables
    return tables


def _single_rows(states: StepStates, device: torch.device) -> torch.Tensor:
    """The one-token sequences' rows as a tensor (once per step)."""
    rows = single_row_index(states, device)
    if isinstance(rows, slice):
        rows = states.scratch.get("single_range")
        if rows is None:
            rows = torch.arange(states.num_single, dtype=torch.int64, device=device)
            states.scratch["single_range"] = rows
    return rows


class TritonKernels:
    name = "triton"

    def conv(self, x, weight, states, layer):
        conv_state, _ = states.layer(layer)
        x = x.contiguous()
        channels, width = conv_state.shape[1], conv_state.shape[2]
        out = torch.empty_like(x)
        block_c = 64
        strides = (x.stride(0), conv_state.stride(0), conv_state.stride(1))
        block_w = _pow2(width, 2)
        if states.num_single:
            grid = (states.num_single, triton.cdiv(channels, block_c))
            rows = _single_rows(states, x.device)
            _conv_update[grid](
                x, weight, conv_state, states.single_slots, rows, out, channels, *strides,
                W=width, BLOCK_C=block_c, BLOCK_W=block_w,
            )  # fmt: skip
        if states.chunks:
            tables = _chunk_tables(states, x.device)
            meta = (tables["start"], tables["len"], tables["slot"])
            block_t = 32
            grid = (
                len(states.chunks),
                triton.cdiv(channels, block_c),
                triton.cdiv(tables["max_len"], block_t),
            )
            _conv_chunk[grid](
                x, weight, conv_state, out, *meta, channels, *strides,
                W=width, BLOCK_T=block_t, BLOCK_C=block_c,
            )  # fmt: skip
            saves = (tables["save_ptr"], tables["save_offset"], tables["save_dst"])
            grid = (len(states.chunks), triton.cdiv(channels, block_c))
            _conv_state[grid](
                x, conv_state, *meta, *saves, channels, *strides,
                W=width, BLOCK_C=block_c, BLOCK_W=block_w,
            )  # fmt: skip
        return out

    def delta_rule(self, q, k, v, g, beta, states, layer):
        _, ssm = states.layer(layer)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g, beta = g.contiguous(), beta.contiguous()
        heads, dv = v.shape[1:]
        dk = k.shape[2]
        repeat = heads // k.shape[1]
        out = torch.empty_like(v)
        scale = dk**-0.5
        block_k, block_v = _pow2(dk), min(_pow2(dv), 64)
        common = (q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0))
        state_strides = (ssm.stride(0), ssm.stride(1), ssm.stride(2))
        if states.num_single:
            grid = (states.num_single, heads, triton.cdiv(dv, block_v))
            rows = _single_rows(states, q.device)
            _recurrent[grid](
                q, k, v, g, beta, ssm, states.single_slots, rows, out, *common, *state_strides,
                REPEAT=repeat, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v,
                scale=scale, eps=EPS,
            )  # fmt: skip
        if states.chunks:
            self._chunks(q, k, v, g, beta, ssm, out, states, common, state_strides)
        return out

    def _chunks(self, q, k, v, g, beta, ssm, out, states, common, state_strides):
        tables = _chunk_tables(states, q.device)
        tokens, heads, dv = v.shape
        dk = k.shape[2]
        repeat = heads // k.shape[1]
        w = torch.empty(tokens, heads, dk, dtype=torch.float32, device=q.device)
        u = torch.empty(tokens, heads, dv, dtype=torch.float32, device=q.device)
        cum = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
        scratch = (w.stride(0), w.stride(1), u.stride(0), u.stride(1))
        block_k, block_v = _pow2(dk), _pow2(dv)
        _chunk_prep[(tables["pieces"], heads)](
            k, v, g, beta, w, u, cum, tables["piece_start"], tables["piece_len"],
            q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), *scratch,
            REPEAT=repeat, DK=dk, DV=dv, BT=tables["bt"], BLOCK_K=block_k, BLOCK_V=block_v,
            eps=EPS,
        )  # fmt: skip
        block_v = min(block_v, 64)
        grid = (len(states.chunks), heads, triton.cdiv(dv, block_v))
        pieces = (tables["piece_start"], tables["piece_len"], tables["piece_dst"])
        _chunk_scan[grid](
            q, k, w, u, cum, ssm, out, tables["slot"], tables["seq_first"], *pieces,
            *common, *scratch, *state_strides,
            REPEAT=repeat, DK=dk, DV=dv, BT=tables["bt"], BLOCK_K=block_k, BLOCK_V=block_v,
            scale=dk**-0.5, eps=EPS,
        )  # fmt: skip
