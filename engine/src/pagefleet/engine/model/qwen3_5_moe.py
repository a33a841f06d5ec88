"""The Qwen3.5-MoE family (`Qwen3_5MoeForCausalLM`, and the published multimodal
`Qwen3_5MoeForConditionalGeneration` whose text model is served: Qwen3.5-35B-A3B and its
larger siblings): Qwen3.5's hybrid layers (model/hybrid.py, Gated DeltaNet and gated attention
by `layer_types`) whose MLP is, in every layer, the mixture-of-experts block (model/moe.py)
with its shared expert behind a sigmoid gate.

config.json (the text model's): `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
`shared_expert_intermediate_size`; no dense MLP (no `intermediate_size`), and the router always
renormalises its top-k probabilities (transformers' router has no `norm_topk_prob`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pagefleet.engine.model.causal_lm import CausalLM
from pagefleet.engine.model.config import MoESpec
from pagefleet.engine.model.hybrid import HybridCausalLM, HybridConfig
from pagefleet.engine.model.layers import TPParts
from pagefleet.engine.model.moe import MoECausalLM, sparse_or_dense_mlp
from pagefleet.engine.model.qwen3_5 import build_hybrid, hybrid_config_from_hf, text_config

MULTIMODAL = "Qwen3_5MoeForConditionalGeneration"
ARCHITECTURES = ("Qwen3_5MoeForCausalLM", MULTIMODAL)


def config_from_hf(cfg: dict, arch: str) -> HybridConfig:
    text = text_config(cfg, arch, MULTIMODAL)
    # Every layer is sparse: no dense MLP, whatever intermediate_size a config carries.
    hybrid = hybrid_config_from_hf({**text, "intermediate_size": 0}, arch)
    moe = MoESpec(
        num_experts=int(text["num_experts"]),
        top_k=int(text.get("num_experts_per_tok", 8)),
        intermediate_size=int(text["moe_intermediate_size"]),
        norm_topk_prob=True,
        sparse_layers=tuple(range(hybrid.num_layers)),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
    )
    return dataclasses.replace(hybrid, moe=moe)


class Qwen3_5MoeForCausalLM(HybridCausalLM, MoECausalLM):
    """The hybrid model's checkpoint names (text prefix, fused in_proj, zero-centred final
    norm) first, then the experts' (per-expert or all-expert tensors, the shared expert and
    its gate); the routing counts come from MoECausalLM."""

    fused_projections: ClassVar[dict[str, tuple[str, str]]] = {
        **HybridCausalLM.fused_projections,
        **MoECausalLM.fused_projections,
    }


def build(cfg: HybridConfig, max_positions: int, tp: TPParts | None = None) -> CausalLM:
    return build_hybrid(cfg, max_positions, tp, sparse_or_dense_mlp, Qwen3_5MoeForCausalLM)
