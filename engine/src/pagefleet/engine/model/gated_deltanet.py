"""The Gated DeltaNet token mixer (Qwen3.5, Qwen3-Next): linear attention whose state per
sequence is constant in the context length.

in_proj (the checkpoint's in_proj_qkv, _z, _b and _a in one matmul) -> short causal depthwise
convolution over q, k and v -> the gated delta rule (decay from a and A_log, write strength
from b) -> RMSNorm of each head's output gated by SiLU(z) -> out_proj. The state (the
convolution's last inputs and each value head's key x value matrix) lives in the step's state
pool, in the slot the KV manager gave the sequence (linear_attn/).

Tensor parallelism splits key and value heads over the ranks (each key head serves a fixed run
of value heads, so contiguous shares stay aligned); out_proj is row-parallel.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.model.layers import RMSNorm, TPParts, output_linear
from pagefleet.engine.model.linear import linear_add
from pagefleet.engine.model.packed import pack_children
from pagefleet.engine.model.weights import (
    Slice,
    TensorSource,
    WeightLoader,
    copy_checked,
    read_piece,
    set_weight_loader,
    whole_loader,
)

if TYPE_CHECKING:
    from pagefleet.engine.model.hybrid import HybridConfig

# Checkpoint projections fused into in_proj, in its row order: (theirs, part).
IN_PROJECTIONS = {
    "linear_attn.in_proj_qkv": ("linear_attn.in_proj", "qkv"),
    "linear_attn.in_proj_z": ("linear_attn.in_proj", "z"),
    "linear_attn.in_proj_b": ("linear_attn.in_proj", "b"),
    "linear_attn.in_proj_a": ("linear_attn.in_proj", "a"),
}


def stacked_loader(parts: dict[Hashable, list[Slice | None]]) -> WeightLoader:
    """Parts stacked along dim 0 of one parameter, in `parts` order; each part's checkpoint
    tensor gives one or more row ranges (this rank's q, k and v heads of in_proj_qkv are three
    pieces of one tensor)."""
    offsets, start = {}, 0
    for part, pieces in parts.items():
        offsets[part] = start
        start += sum(p.length for p in pieces)

    def load(param: nn.Parameter, source: TensorSource, part: Hashable) -> None:
        rows = torch.cat([read_piece(source, piece) for piece in parts[part]])
        dest = param.data.narrow(0, offsets[part], rows.shape[0])
        copy_checked(dest, rows, f"{source.name} (part {part})")

    return load


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: HybridConfig, layer_index: int, tp: TPParts | None = None) -> None:
        super().__init__()
        size, rank = (tp.layout.size, tp.layout.rank) if tp else (1, 0)
        self.state_index = cfg.linear_slot(layer_index)
        self.num_k_heads = cfg.linear_num_key_heads // size
        self.num_v_heads = cfg.linear_num_value_heads // size
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_local = self.num_k_heads * self.k_dim
        value_local = self.num_v_heads * self.v_dim
        key_all = cfg.linear_num_key_heads * self.k_dim
        self.splits = [key_local, key_local, value_local]  # q, k, v after the convolution
        # This rank's rows of the convolved q | k | v channels, in the checkpoint's tensor.
        qkv = [
            Slice(0, rank * key_local, key_local),
            Slice(0, key_all + rank * key_local, key_local),
            Slice(0, 2 * key_all + rank * value_local, value_local),
        ]
        heads = Slice(0, rank * self.num_v_heads, self.num_v_heads)
        parts = {
            "qkv": qkv,
            "z": [Slice(0, rank * value_local, value_local)],
            "b": [heads],
            "a": [heads],
        }
        self.proj_sizes = [sum(self.splits), value_local, self.num_v_heads, self.num_v_heads]
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.proj_sizes), bias=False)
        set_weight_loader(self.in_proj, "weight", stacked_loader(parts), parts)
        kernel = cfg.linear_conv_kernel_dim
        channels = sum(self.splits)
        self.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)
        set_weight_loader(self.conv1d, "weight", stacked_loader({None: qkv}))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        set_weight_loader(self, "A_log", whole_loader(heads))
        set_weight_loader(self, "dt_bias", whole_loader(heads))
        self.norm = RMSNorm(self.v_dim, cfg.rms_norm_eps)  # gated: see forward
        self.out_proj = output_linear(value_local, cfg.hidden_size, False, tp)

    def forward(self, x, positions, rope, backend, kv_caches, meta, residual):
        """residual + this layer's output; the state moves on in the step's slots."""
        states = meta.states
        kernels = states.kernels
        tokens = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(self.proj_sizes, dim=-1)
        weight = self.conv1d.weight.view(self.conv1d.weight.shape[0], -1)
        mixed = kernels.conv(mixed, weight, states, self.state_index)
        q, k, v = mixed.split(self.splits, dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = kernels.delta_rule(
            q.reshape(tokens, self.num_k_heads, self.k_dim),
            k.reshape(tokens, self.num_k_heads, self.k_dim),
            v.reshape(tokens, self.num_v_heads, self.v_dim),
            g,
            beta,
            states,
            self.state_index,
        )
        gate = F.silu(z.reshape(tokens, self.num_v_heads, self.v_dim))
        out = self.norm(out) * gate
        return linear_add(self.out_proj, out.reshape(tokens, -1), residual)

    def prepack(self) -> None:
        pack_children(self, ("in_proj", "out_proj"))
