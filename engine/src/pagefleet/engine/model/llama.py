"""The dense Llama family: Llama, Mistral, Qwen2 and Qwen3 checkpoints.

Differences are switches read from config.json: q/k/v bias (Qwen2), per-head q/k RMSNorm and
an explicit head_dim (Qwen3), tied embeddings, rope scaling.
"""

from __future__ import annotations

from torch import nn

from pagefleet.engine.model.causal_lm import CausalLM
from pagefleet.engine.model.config import ModelConfig
from pagefleet.engine.model.layers import MLP, Attention, RMSNorm, TPParts
from pagefleet.engine.model.rope import rope_params

# Base models (no LM head: embedding checkpoints such as e5-mistral or gte-Qwen2 save these)
# are the same decoders; the pooling runner serves them (pooling/config.py).
BASE_MODELS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
ARCHITECTURES = (*BASE_MODELS.values(), *BASE_MODELS)


def config_from_hf(cfg: dict, arch: str) -> ModelConfig:
    arch = BASE_MODELS.get(arch, arch)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    heads = cfg["num_attention_heads"]
    return ModelConfig(
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


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added to the residual."""

    # The shape model/one_row_decode.py runs as one call at one row.
    one_row_fusable = True

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

    def prepack(self) -> None:
        self.self_attn.prepack()
        self.mlp.prepack()


def build(cfg: ModelConfig, max_positions: int, tp: TPParts | None = None) -> CausalLM:
    return CausalLM(cfg, max_positions, tp, DecoderLayer)
