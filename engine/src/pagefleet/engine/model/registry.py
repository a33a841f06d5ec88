"""Which model family serves a checkpoint: its config.json's `architectures` name a family
module, as vLLM's model directory does. A new architecture is a new module listed here; the
engine core never learns about families.

A family module exposes `ARCHITECTURES`, `config_from_hf(hf_config, architecture) ->
ModelConfig` and `build(cfg, max_positions, tp) -> CausalLM` (model/causal_lm.py's interface).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pagefleet.engine.model.config import ModelConfig

# Family modules, tried in order (imported on first use, so a family's optional dependencies
# cost nothing to engines that serve another).
FAMILIES = (
    "pagefleet.engine.model.llama",
    "pagefleet.engine.model.qwen3_5",
    "pagefleet.engine.model.qwen3_moe",
    "pagefleet.engine.model.mixtral",
    "pagefleet.engine.model.qwen3_5_moe",
)


def _families() -> list[ModuleType]:
    return [importlib.import_module(name) for name in FAMILIES]


def supported_architectures() -> list[str]:
    return [arch for family in _families() for arch in family.ARCHITECTURES]


def family_of(hf_config: dict) -> tuple[ModuleType, str]:
    """The family module serving this config.json, and the architecture it matched."""
    archs = hf_config.get("architectures") or []
    for family in _families():
        for arch in archs:
            if arch in family.ARCHITECTURES:
                return family, arch
    raise ValueError(
        f"architectures {archs} are not supported; supported: "
        f"{', '.join(supported_architectures())}"
    )


def model_config(hf_config: dict) -> ModelConfig:
    """The engine's view of a checkpoint's config.json (its family parses it)."""
    family, arch = family_of(hf_config)
    return family.config_from_hf(hf_config, arch)
