"""One decoder-only transformer covering Llama, Mistral, Qwen2 and Qwen3 checkpoints.

Differences are switches read from config.json: q/k/v bias (Qwen2), per-head q/k RMSNorm and an
explicit head_dim (Qwen3), tied embeddings, rope scaling. Tokens arrive flattened (no padding);
attention goes through an `AttentionBackend` over the paged KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.attention.backend import AttentionBackend, AttentionMetadata, LayerKV
from pagefleet.engine.model.packed import linear_add, pack_children
from pagefleet.engine.model.parallel import (
    Collectives,
    ParallelLMHead,
    RowParallelLinear,
    TPLayout,
    VocabParallelEmbedding,
)
from pagefleet.engine.model.rope import RotaryEmbedding, rope_params

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict
    eos_token_id: int | list[int] | None
    bos_token_id: int | None

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"architectures {archs} are not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
        heads = cfg["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            # Llama-style attention_bias also biases o_proj; Qwen2 biases q/k/v only.
            o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope=rope_params(cfg),
            eos_token_id=cfg.get("eos_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def _output_linear(
    in_features: int, out_features: int, bias: bool, tp: TPParts | None
) -> nn.Module:
    """o_proj / down_proj: a plain linear on one rank, row-parallel over several."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp.group)


@dataclass(frozen=True)
class TPParts:
    """A rank's share of the model and the group its layers reduce over (None on one rank)."""

    layout: TPLayout
    group: Collectives


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, tp: TPParts | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = tp.layout.num_heads if tp else cfg.num_heads
        self.num_kv_heads = tp.layout.num_kv_heads if tp else cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # q, k and v in one matmul: loaded from the checkpoint's three projections.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = _output_linear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, positions, rope, backend, kv_caches, meta, residual):
        """residual + this layer's attention output (the residual's storage may be reused)."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        cache = kv_caches[self.layer_index]  # a LayerKV (attention/backend.py)
        out = backend.forward(q, k, v, cache.k_cache, cache.v_cache, meta, self.scale, cache.scales)
        return linear_add(self.o_proj, out.reshape(-1, self.q_size), residual)

    def prepack(self) -> None:
        pack_children(self, ("qkv_proj", "o_proj"))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPParts | None = None) -> None:
        super().__init__()
        self.intermediate = tp.layout.intermediate_size if tp else cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, cfg.mlp_bias)
        self.down_proj = _output_linear(self.intermediate, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + this MLP's output (the residual's storage may be reused)."""
        fused = self.gate_up_proj(x)
        # narrow, not split: autograd refuses in-place ops on split's views even where no
        # gradient is wanted (benchmarks call the model outside inference mode).
        gate = fused.narrow(-1, 0, self.intermediate)
        up = fused.narrow(-1, self.intermediate, self.intermediate)
        # SiLU in place over the gate half (a view of the fused output nothing else reads),
        # then one product: one temporary instead of two.
        return linear_add(self.down_proj, torch.mul(F.silu(gate, inplace=True), up), residual)

    def prepack(self) -> None:
        pack_children(self, ("gate_up_proj", "down_proj"))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, tp: TPParts | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, positions, rope, backend, kv_caches, meta):
        h = self.input_layernorm(x)
        x = self.self_attn(h, positions, rope, backend, kv_caches, meta, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class CausalLM(nn.Module):
    """The whole model, or (with `tp`) one tensor-parallel rank's shard of it, whose
    `compute_logits` returns the full logits on rank 0 and None on the others."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPParts | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        if tp is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(tp.layout, cfg.hidden_size, tp.group)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if tp is None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.lm_head = ParallelLMHead(tp.layout, cfg.hidden_size, tp.group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rope, backend, kv_caches, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def prepack(self) -> None:
        """Move every linear layer onto oneDNN-prepacked weights (model/packed.py): call once,
        after the weights are loaded, on a float32 CPU model."""
        for layer in self.layers:
            layer.self_attn.prepack()
            layer.mlp.prepack()
        pack_children(self, ("lm_head",))

    @property
    def num_kv_heads(self) -> int:
        """KV heads this model (or rank) keeps in its pool."""
        return self.tp.layout.num_kv_heads if self.tp else self.config.num_kv_heads
