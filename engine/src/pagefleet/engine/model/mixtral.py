"""The Mixtral family (`MixtralForCausalLM`): Mistral's attention and, in every layer, a
top-2 router over 8 experts (`num_local_experts`, `num_experts_per_tok`; each expert an MLP of
`intermediate_size`, its matrices named w1 (gate), w3 (up), w2 (down) under
`block_sparse_moe`). The top-k probabilities are always renormalised.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pagefleet.engine.model import llama
from pagefleet.engine.model.config import ModelConfig, MoESpec
from pagefleet.engine.model.layers import TPParts
from pagefleet.engine.model.moe import MoECausalLM, MoEDecoderLayer

ARCHITECTURES = ("MixtralForCausalLM",)


def config_from_hf(cfg: dict, arch: str) -> ModelConfig:
    dense = llama.config_from_hf(cfg, "MistralForCausalLM")  # its attention is Mistral's
    moe = MoESpec(
        num_experts=int(cfg.get("num_local_experts", 8)),
        top_k=int(cfg.get("num_experts_per_tok", 2)),
        intermediate_size=dense.intermediate_size,
        norm_topk_prob=True,
        sparse_layers=tuple(range(dense.num_layers)),
    )
    return dataclasses.replace(dense, architecture=arch, moe=moe)


class MixtralForCausalLM(MoECausalLM):
    renames: ClassVar[dict[str, str]] = {**MoECausalLM.renames, ".block_sparse_moe.": ".mlp."}


def build(cfg: ModelConfig, max_positions: int, tp: TPParts | None = None) -> MoECausalLM:
    return MixtralForCausalLM(cfg, max_positions, tp, MoEDecoderLayer)
