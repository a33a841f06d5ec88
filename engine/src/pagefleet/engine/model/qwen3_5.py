"""The Qwen3.5 family: hybrid decoders of Gated DeltaNet and gated attention layers
(model/hybrid.py). Published checkpoints are the multimodal `Qwen3_5ForConditionalGeneration`:
their text model is served (the vision tower is not loaded; image inputs are refused by the
API), and their config nests the text model's under `text_config`.
"""

from __future__ import annotations

import functools
import logging

from pagefleet.engine.model.causal_lm import CausalLM
from pagefleet.engine.model.hybrid import (
    FULL,
    HybridCausalLM,
    HybridConfig,
    HybridDecoderLayer,
    MLPFactory,
    default_mlp,
    parse_layer_types,
)
from pagefleet.engine.model.layers import TPParts
from pagefleet.engine.model.rope import rope_params

logger = logging.getLogger("pagefleet.engine")

MULTIMODAL = "Qwen3_5ForConditionalGeneration"
ARCHITECTURES = ("Qwen3_5ForCausalLM", MULTIMODAL)


def text_config(cfg: dict, arch: str, multimodal: str = MULTIMODAL) -> dict:
    """The language model's config: a multimodal checkpoint's (`arch` == `multimodal`)
    `text_config`, its dtype and token ids filled in from the outer config when only that says
    them."""
    if arch != multimodal:
        return cfg
    logger.info("%s: serving its text model (images and video are not supported)", arch)
    text = dict(cfg.get("text_config") or {})
    for key in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in text and key in cfg:
            text[key] = cfg[key]
    return text


def hybrid_config_from_hf(cfg: dict, arch: str) -> HybridConfig:
    """The fields every hybrid family of this shape shares (Qwen3.5 and its MoE variant)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    kinds = parse_layer_types(cfg)
    heads = cfg["num_attention_heads"]
    return HybridConfig(
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
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=False,
        qk_norm=True,
        rope=qwen_rope(cfg),
        eos_token_id=cfg.get("eos_token_id"),
        bos_token_id=cfg.get("bos_token_id"),
        kv_layer_indices=tuple(i for i, kind in enumerate(kinds) if kind == FULL),
        layer_types=kinds,
        linear_num_key_heads=cfg["linear_num_key_heads"],
        linear_num_value_heads=cfg["linear_num_value_heads"],
        linear_key_head_dim=cfg["linear_key_head_dim"],
        linear_value_head_dim=cfg["linear_value_head_dim"],
        linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
    )


def qwen_rope(cfg: dict) -> dict:
    """rope settings; a config silent on partial rotation rotates a quarter of each head, as
    transformers' Qwen3.5 config defaults it."""
    params = rope_params(cfg)
    given = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "partial_rotary_factor" not in cfg and "partial_rotary_factor" not in given:
        params["partial_rotary_factor"] = 0.25
    return params


def config_from_hf(cfg: dict, arch: str) -> HybridConfig:
    return hybrid_config_from_hf(text_config(cfg, arch), arch)


def build_hybrid(
    cfg: HybridConfig,
    max_positions: int,
    tp: TPParts | None,
    mlp_factory: MLPFactory,
    model_cls: type[HybridCausalLM] = HybridCausalLM,
) -> CausalLM:
    layer = functools.partial(HybridDecoderLayer, mlp_factory=mlp_factory)
    return model_cls(cfg, max_positions, tp, layer)


def build(cfg: HybridConfig, max_positions: int, tp: TPParts | None = None) -> CausalLM:
    return build_hybrid(cfg, max_positions, tp, default_mlp)
