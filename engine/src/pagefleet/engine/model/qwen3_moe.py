"""The Qwen3-MoE family (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's
attention (per-head q/k RMSNorm) and, in its sparse layers, a top-k router over the experts.

config.json: `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`;
a layer is sparse when it is not in `mlp_only_layers` and (index + 1) is a multiple of
`decoder_sparse_step`; the others hold a dense MLP of `intermediate_size`.
"""

from __future__ import annotations

import dataclasses

from pagefleet.engine.model import llama
from pagefleet.engine.model.config import ModelConfig, MoESpec
from pagefleet.engine.model.moe import build

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
__all__ = ["ARCHITECTURES", "build", "config_from_hf"]


def config_from_hf(cfg: dict, arch: str) -> ModelConfig:
    # Its attention and norms are Qwen3's: the dense family reads them.
    dense = llama.config_from_hf(cfg, "Qwen3ForCausalLM")
    layers = dense.num_layers
    # Hub configs say num_experts; transformers 5 writes its alias num_local_experts.
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return dataclasses.replace(dense, architecture=arch)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or ())
    moe = MoESpec(
        num_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok", 8)),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=tuple(
            i for i in range(layers) if i not in dense_only and (i + 1) % step == 0
        ),
    )
    return dataclasses.replace(dense, architecture=arch, moe=moe)
