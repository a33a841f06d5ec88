"""A step's causal convolution and gated delta rule over the batch layout (single-token rows,
then prompt chunks), reading and writing each sequence's slot: `TorchKernels` on CPU,
`TritonKernels` (linear_attn/triton_ops.py) on GPU. `select_kernels` picks them to match the
attention backend.

Snapshots inside a chunk (a prefix-cache boundary, or the state a prefill pod hands to a decode
pod) split the chunk there: the rule runs segment by segment and the state after each named
offset is copied to its destination slot.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagefleet.engine.linear_attn import torch_ops
from pagefleet.engine.linear_attn.state import StateChunk, StepStates, single_row_index


class LinearAttnKernels(Protocol):
    name: str

    def conv(
        self, x: torch.Tensor, weight: torch.Tensor, states: StepStates, layer: int
    ) -> torch.Tensor:
        """SiLU(causal depthwise conv) of x [T, C] (weight [C, W + 1]), each sequence
        continuing from its slot's last inputs; updates the slots."""
        ...

    def delta_rule(
        self,
        q: torch.Tensor,  # [T, key heads, Dk]
        k: torch.Tensor,
        v: torch.Tensor,  # [T, value heads, Dv]
        g: torch.Tensor,  # [T, value heads] float32 log decay
        beta: torch.Tensor,  # [T, value heads]
        states: StepStates,
        layer: int,
    ) -> torch.Tensor:
        """Outputs [T, value heads, Dv] in v's dtype; updates the slots."""
        ...


def segments(chunk: StateChunk) -> list[tuple[int, int, int | None]]:
    """(first offset, end offset, slot to copy the state to after it) covering the chunk."""
    out, start = [], 0
    for offset, dst in chunk.saves:
        out.append((start, offset, dst))
        start = offset
    out.append((start, chunk.num_tokens, None))
    return out


class TorchKernels:
    name = "torch"

    def conv(self, x, weight, states, layer):
        conv_state, _ = states.layer(layer)
        out = torch.empty_like(x)
        if states.num_single:
            slots, rows = states.single_slots, single_row_index(states, x.device)
            y, new = torch_ops.conv_update(x[rows], conv_state[slots].to(x.dtype), weight)
            out[rows] = y
            conv_state[slots] = new.to(conv_state.dtype)
        width = conv_state.shape[-1]
        for chunk in states.chunks:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            y, inputs = torch_ops.conv_segment(x[rows], conv_state[chunk.slot], weight)
            out[rows] = y
            for offset, dst in chunk.saves:  # the W inputs before row `offset`
                conv_state[dst] = inputs[:, offset : offset + width]
            conv_state[chunk.slot] = inputs[:, chunk.num_tokens :]
        return out

    def delta_rule(self, q, k, v, g, beta, states, layer):
        _, ssm = states.layer(layer)
        q, k = torch_ops.prepare_qk(q, k, v.shape[1])
        v32, beta = v.float(), beta.float()
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        if states.num_single:
            slots, rows = states.single_slots, single_row_index(states, v.device)
            o, new = torch_ops.recurrent_step(
                q[rows], k[rows], v32[rows], g[rows], beta[rows], ssm[slots].float()
            )
            out[rows] = o
            ssm[slots] = new.to(ssm.dtype)
        for chunk in states.chunks:
            state = ssm[chunk.slot].float()
            for first, end, dst in segments(chunk):
                rows = slice(chunk.start + first, chunk.start + end)
                out[rows], state = torch_ops.chunked(
                    q[rows], k[rows], v32[rows], g[rows], beta[rows], state
                )
                if dst is not None:
                    ssm[dst] = state.to(ssm.dtype)
            ssm[chunk.slot] = state.to(ssm.dtype)
        return out.to(v.dtype)


def select_kernels(attention_backend: str) -> LinearAttnKernels:
    """The kernels that go with the attention backend: Triton beside Triton (GPU, or the
    interpreter in tests), torch otherwise."""
    if attention_backend == "triton":
        from pagefleet.engine.linear_attn.triton_ops import TritonKernels

        return TritonKernels()
    return TorchKernels()
