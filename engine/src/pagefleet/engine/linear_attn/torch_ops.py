"""The gated delta rule and the short causal convolution in plain torch: the CPU path, and the
reference the Triton kernels are tested against.

The delta rule keeps, per value head, a key x value matrix S. For each token, with decay
exp(g), write strength beta, l2-normalised key k and query q (q scaled by key_dim^-1/2):

    S <- exp(g) S;   u = beta (v - S^T k);   S <- S + k u^T;   o = S^T q

`recurrent_step` does that for one token of many sequences (decode). `chunked` does a whole
segment of one sequence in chunks of CHUNK tokens: inside a chunk the recurrence is solved as a
unit-lower-triangular system (the WY form of the DeltaNet papers), so the work is matmuls;
between chunks S is carried. All arithmetic is float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the reference implementation's epsilon)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, ...]:
    """[T, key heads, Dk] queries and keys as the rule reads them: float32, l2-normalised, one
    per value head (each key head serves num_v_heads / key heads consecutive value heads), the
    queries scaled by Dk^-1/2."""
    q, k = l2norm(q.float()), l2norm(k.float())
    repeat = num_v_heads // k.shape[1]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    return q * q.shape[-1] ** -0.5, k


def recurrent_step(
    q: torch.Tensor,  # [B, H, Dk] float32, prepared
    k: torch.Tensor,
    v: torch.Tensor,  # [B, H, Dv] float32
    g: torch.Tensor,  # [B, H] log decay
    beta: torch.Tensor,  # [B, H]
    state: torch.Tensor,  # [B, H, Dk, Dv] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: (outputs [B, H, Dv], new states)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    update = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * update[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def chunked(
    q: torch.Tensor,  # [T, H, Dk] float32, prepared
    k: torch.Tensor,
    v: torch.Tensor,  # [T, H, Dv] float32
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv] float32
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one sequence from `state`: (outputs [T, H, Dv], the state after them).

    Within a chunk with cumulative log decay G_t, the writes u solve
    (I + A) u = beta v - beta exp(G) k S0, A[t, i] = beta_t exp(G_t - G_i) k_t.k_i (i < t);
    outputs are exp(G_t) q_t S0 + sum_{i<=t} exp(G_t - G_i) (q_t.k_i) u_i, and the state
    after the chunk exp(G_C) S0 + sum_i exp(G_C - G_i) k_i u_i^T. Padding tokens (beta 0,
    g 0) write nothing and decay nothing; a segment shorter than `chunk` is padded only to a
    multiple of 16 (a prompt chunk under a small token budget would mostly be padding)."""
    length = q.shape[0]
    chunk = min(chunk, -(-length // 16) * 16)
    pad = -length % chunk
    # [H, chunks, C, D]: heads first, so each chunk's matmuls batch over heads.
    q, k, v = (_chunks(F.pad(x, (0, 0, 0, 0, 0, pad)), chunk) for x in (q, k, v))
    g, beta = (_chunks(F.pad(x, (0, 0, 0, pad)), chunk) for x in (g, beta))
    cum = g.cumsum(-1)  # [H, N, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    lower = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    solve = torch.linalg.solve_triangular
    system = eye + lower
    values = solve(system, v * beta[..., None], upper=False, unitriangular=True)
    keys = solve(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = q @ k.transpose(-1, -2) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        u = values[:, c] - keys[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ u
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ u
    return out.flatten(1, 2)[:, :length].transpose(0, 1), state


def _chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[T, H, ...] -> [H, T / chunk, chunk, ...]."""
    x = x.transpose(0, 1)
    return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])


def conv_update(
    x: torch.Tensor,  # [B, C]: each sequence's new input
    conv_state: torch.Tensor,  # [B, C, W]: its last W inputs
    weight: torch.Tensor,  # [C, W + 1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: (SiLU(conv) [B, C], the new last-W inputs)."""
    window = torch.cat([conv_state, x.unsqueeze(-1)], dim=-1)
    return F.silu((window * weight).sum(-1)), window[..., 1:]


def conv_segment(
    x: torch.Tensor,  # [T, C]: one sequence's inputs
    conv_state: torch.Tensor,  # [C, W]: the W inputs before them
    weight: torch.Tensor,  # [C, W + 1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one sequence: (SiLU(conv) [T, C], inputs [C, W + T] with the W before).
    The few taps are summed directly (cheaper than conv1d's set-up at these sizes)."""
    inputs = torch.cat([conv_state, x.transpose(0, 1).to(conv_state.dtype)], dim=1)
    length = x.shape[0]
    out = inputs[:, :length] * weight[:, :1]
    for tap in range(1, weight.shape[1]):
        out += inputs[:, tap : tap + length] * weight[:, tap : tap + 1]
    return F.silu(out).transpose(0, 1), inputs
