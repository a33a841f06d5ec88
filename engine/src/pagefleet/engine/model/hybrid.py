"""Hybrid decoder models (Qwen3.5, Qwen3-Next): most layers mix tokens with Gated DeltaNet
(linear attention, a constant-size state per sequence), every few a gated full-attention layer
over the paged KV pool; `layer_types` says which. Families build on these pieces: the config,
the gated attention, the decoder layer (its MLP from a factory, so a mixture-of-experts family
passes its MoE block) and the causal LM (multimodal checkpoints' text weights, zero-centred
norms).

Zero-centred RMSNorm (weight w, applied as 1 + w) is loaded as 1 + w into a plain RMSNorm.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from pagefleet.common.capacity import UNSERVED_PREFIXES
from pagefleet.engine.model.causal_lm import FUSED_PROJECTIONS, CausalLM
from pagefleet.engine.model.config import ModelConfig, SequenceStateShape
from pagefleet.engine.model.gated_deltanet import IN_PROJECTIONS, GatedDeltaNet
from pagefleet.engine.model.layers import MLP, Attention, RMSNorm, TPParts
from pagefleet.engine.model.linear import linear_add
from pagefleet.engine.model.weights import (
    TensorSource,
    WeightLoader,
    copy_checked,
    set_weight_loader,
)

LINEAR = "linear_attention"
FULL = "full_attention"
LAYER_TYPES = (LINEAR, FULL)

# mlp_factory(cfg, layer_index, tp) -> the layer's MLP, whose forward is (x, residual) -> x.
MLPFactory = Callable[[ModelConfig, int, TPParts | None], nn.Module]


@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    @property
    def linear_layer_indices(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR)

    def linear_slot(self, layer_index: int) -> int:
        """Decoder layer `layer_index`'s place among the linear-attention layers."""
        return self.linear_layer_indices.index(layer_index)

    def state_shape(self, tp_size: int = 1) -> SequenceStateShape | None:
        layers = len(self.linear_layer_indices)
        if not layers:
            return None
        k_heads = self.linear_num_key_heads // tp_size
        v_heads = self.linear_num_value_heads // tp_size
        k_dim, v_dim = self.linear_key_head_dim, self.linear_value_head_dim
        return SequenceStateShape(
            num_layers=layers,
            conv_channels=2 * k_heads * k_dim + v_heads * v_dim,
            conv_width=self.linear_conv_kernel_dim - 1,
            num_heads=v_heads,
            key_dim=k_dim,
            value_dim=v_dim,
        )

    def split_sizes(self) -> dict[str, int]:
        return {
            **super().split_sizes(),
            "linear-attention key heads": self.linear_num_key_heads,
            "linear-attention value heads": self.linear_num_value_heads,
        }


def parse_layer_types(cfg: dict) -> tuple[str, ...]:
    """`layer_types`, or every `full_attention_interval`-th layer full (Qwen3-Next's form)."""
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = cfg.get("full_attention_interval", 4)
        kinds = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    kinds = tuple(kinds)
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown or len(kinds) != layers:
        raise ValueError(
            f"layer_types must list {layers} layers of {LAYER_TYPES}; got {len(kinds)}"
            + (f" with {unknown}" if unknown else "")
        )
    return kinds


def offset_loader(offset: float) -> WeightLoader:
    """A zero-centred norm weight w stored as offset + w (so RMSNorm applies it as is)."""

    def load(param: nn.Parameter, source: TensorSource, part: Hashable) -> None:
        copy_checked(param.data, source.read().to(param.dtype) + offset, source.name)

    return load


def centred_norm(dim: int, eps: float) -> RMSNorm:
    norm = RMSNorm(dim, eps)
    set_weight_loader(norm, "weight", offset_loader(1.0))
    return norm


class GatedAttention(Attention):
    """Full attention with per-head q/k norms (zero-centred), partial rotary positions (the
    model's rope) and an output gate: q_proj gives each head's query then its gate, and the
    attention output is multiplied by sigmoid(gate) before o_proj."""

    q_rows_per_head = 2

    def __init__(self, cfg: ModelConfig, layer_index: int, tp: TPParts | None = None) -> None:
        super().__init__(cfg, layer_index, tp)
        self.q_norm = centred_norm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = centred_norm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, positions, rope, backend, kv_caches, meta, residual):
        hd = self.head_dim
        q_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], -1)
        q_gate = q_gate.view(-1, self.num_heads, 2 * hd)
        q, gate = q_gate[..., :hd], q_gate[..., hd:]
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, hd))
        v = v.reshape(-1, self.num_kv_heads, hd)
        q, k = rope(q, k)
        cache = kv_caches[self.kv_slot]
        out = backend.forward(q, k, v, cache.k_cache, cache.v_cache, meta, self.scale, cache.scales)
        out = out.reshape(-1, self.q_size) * torch.sigmoid(gate.reshape(-1, self.q_size))
        return linear_add(self.o_proj, out, residual)


def default_mlp(cfg: ModelConfig, layer_index: int, tp: TPParts | None) -> nn.Module:
    return MLP(cfg, tp)


class HybridDecoderLayer(nn.Module):
    """Pre-norm token mixer (Gated DeltaNet or gated attention, by `layer_types`), then the
    pre-norm MLP, each added to the residual."""

    def __init__(
        self,
        cfg: HybridConfig,
        layer_index: int,
        tp: TPParts | None = None,
        mlp_factory: MLPFactory = default_mlp,
    ) -> None:
        super().__init__()
        self.input_layernorm = centred_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_linear = cfg.layer_types[layer_index] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_index, tp)
        else:
            self.self_attn = GatedAttention(cfg, layer_index, tp)
        self.post_attention_layernorm = centred_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp_factory(cfg, layer_index, tp)

    def forward(self, x, positions, rope, backend, kv_caches, meta):
        mixer = self.linear_attn if self.is_linear else self.self_attn
        x = mixer(self.input_layernorm(x), positions, rope, backend, kv_caches, meta, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)

    def prepack(self) -> None:
        (self.linear_attn if self.is_linear else self.self_attn).prepack()
        self.mlp.prepack()


# Multimodal checkpoints keep the language model under this prefix (their vision tower and
# multi-token-prediction head, UNSERVED_PREFIXES, are not served).
TEXT_PREFIX = "model.language_model."


class HybridCausalLM(CausalLM):
    """CausalLM with hybrid layers: the checkpoint's linear-attention projections fuse into
    in_proj, a multimodal checkpoint's text weights load and the rest is skipped, and the final
    norm is zero-centred."""

    fused_projections: ClassVar[dict[str, tuple[str, str]]] = {
        **FUSED_PROJECTIONS,
        **IN_PROJECTIONS,
    }

    def __init__(self, cfg, max_positions, tp, make_layer) -> None:
        super().__init__(cfg, max_positions, tp, make_layer)
        set_weight_loader(self.norm, "weight", offset_loader(1.0))

    def checkpoint_target(self, name: str) -> tuple[str, Hashable] | None:
        if name.startswith(UNSERVED_PREFIXES):
            return None
        if name.startswith(TEXT_PREFIX):
            name = "model." + name.removeprefix(TEXT_PREFIX)
        return super().checkpoint_target(name)
