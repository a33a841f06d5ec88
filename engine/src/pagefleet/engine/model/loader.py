"""Load a checkpoint into the model its family builds: config, tensors, tokenizer dtype.

The model is built on the meta device (no initialisation), materialised on the target device,
then every checkpoint tensor goes to the parameter its name maps to, through that parameter's
weight loader (model/weights.py), which reads only this rank's slice under tensor parallelism.
A parameter whose parts did not all arrive is an error naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagefleet.engine.kv_cache.fp8 import FP8_KV_DTYPE, LayerScales, is_fp8, is_kv_scale
from pagefleet.engine.model.causal_lm import CausalLM
from pagefleet.engine.model.checkpoint import kv_scales, read_config, tensor_sources, weight_files
from pagefleet.engine.model.layers import TPParts
from pagefleet.engine.model.linear_plan import float_weights_by_shape, linear_plan
from pagefleet.engine.model.quant.config import (
    QuantFormat,
    choose_methods,
    resolve_quantization,
    weights_label,
)
from pagefleet.engine.model.registry import family_of, model_config
from pagefleet.engine.model.weights import param_loaders

__all__ = ["kv_cache_format", "load_model", "read_config", "resolve_dtype", "weight_files"]

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (--dtype): auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def kv_cache_format(
    kv_cache_dtype: str, dtype: torch.dtype, device: torch.device, path: str | Path
) -> tuple[torch.dtype, list[LayerScales] | None]:
    """The KV pool's dtype for --kv-cache-dtype (auto: the model's `dtype`) and, for fp8, the
    per-layer (k_scale, v_scale): the checkpoint's calibrated ones, 1.0 where it has none. Every
    tensor-parallel rank reads the same scales (they are per layer, not per head)."""
    if is_fp8(kv_cache_dtype):
        num_layers = model_config(read_config(path)).num_layers
        return FP8_KV_DTYPE, kv_scales(path, num_layers)
    return (dtype if kv_cache_dtype == "auto" else resolve_dtype(kv_cache_dtype, device)), None


def build_model(
    hf_config: dict,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp=None,
    quant: QuantFormat | None = None,
    lm_head: bool = True,
) -> CausalLM:
    """The family's model for this config, its linear layers on the methods `quant` chooses
    (model/quant/), materialised (uninitialised) on `device`; without its LM head for a
    pooling engine (`lm_head` False)."""
    family, arch = family_of(hf_config)
    cfg = family.config_from_hf(hf_config, arch)
    with torch.device("meta"):
        model = family.build(cfg, max_positions, tp).to(dtype)
        if not lm_head:
            model.drop_lm_head()
        if quant is not None:  # after the cast: a method's fp8 or int codes keep their dtype
            choose_methods(model, quant, dtype)
    model = model.to_empty(device=device)
    model.materialize(device)
    return model


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TPParts | None = None,
    linear_path: str = "packed",
    quantization: str | None = None,
    lm_head: bool = True,
) -> CausalLM:
    """The model (or with `tp`, this rank's shard of it) on `device`, in `dtype`; each linear
    layer's weights are then processed for its kernel (model/linear.py): on a float32 CPU
    model oneDNN-prepacked (model/packed.py) as `linear_path` says (--linear-path: packed,
    plain, or auto: per shape by measurement, model/linear_plan.py; auto also measures where
    4-bit weights' prompt steps run, quant/int4_tiles.py). The default here is
    packed, so a library caller, test or benchmark loads without measuring; the engine passes
    its --linear-path (default auto); plain is the tests' unpacked reference. `quantization`
    is --quantization (None: the checkpoint's own, model/quant/config.py). A pooling engine
    loads it without the LM head (`lm_head` False)."""
    hf_config = read_config(path)
    quant = resolve_quantization(quantization, hf_config, path)
    model = build_model(hf_config, dtype, device, max_positions, tp, quant, lm_head)
    model.weights_format = weights_label(quant, hf_config, quantization, dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaders = param_loaders(model)
    arrived: dict[str, set] = {}
    for source in tensor_sources(path):
        if is_kv_scale(source.name):
            continue  # KV scales belong to the cache (kv_cache_format), not the weights
        target = model.checkpoint_target(source.name)
        if target is None:
            continue
        name, part = target
        if name not in loaders:
            raise ValueError(f"unexpected weight {source.name!r} in checkpoint {path}")
        filled = loaders[name].load(params.get(name), source, part)
        arrived.setdefault(name, set()).update({part} if filled is None else filled)
    _check_complete(model, loaders, arrived, path)
    weights = float_weights_by_shape(model)
    fusable = linear_path == "auto" and _declares_fusable(model)
    layers = _fusable_shapes(model) if weights and fusable else frozenset()
    model.process_weights(linear_plan(linear_path, weights, layer_shapes=layers))
    if linear_path == "auto" and quant is not None and device.type == "cpu":
        from pagefleet.engine.model.quant.cpu_kernels import choose_prompt_tiles

        choose_prompt_tiles(model)  # 4-bit prompt steps on tiles, where they measure faster
        if fusable and model.one_row_decoder is None:
            model.fuse_one_row_layers(coded_head=True)  # on codes a byte each, where they fit
    return model.eval()


def _declares_fusable(model: CausalLM) -> bool:
    """Whether the family's layers have the shape the fused one-row layers run (checked
    before importing, and maybe compiling, their kernel)."""
    return all(getattr(layer, "one_row_fusable", False) for layer in model.layers)


def _fusable_shapes(model: CausalLM) -> frozenset[tuple[int, int]]:
    from pagefleet.engine.model.one_row_decode import fusable_shapes  # numba's, CPU only

    return fusable_shapes(model)


def _check_complete(model: CausalLM, loaders: dict, arrived: dict[str, set], path) -> None:
    """Every parameter got all its parts (a tied LM head shares the embedding's)."""
    lacking = []
    for name, _ in model.named_parameters():  # tied parameters are listed once
        loader = loaders.get(name)
        if loader is None:
            lacking.append(f"{name} (no loader)")
            continue
        missing = loader.parts - arrived.get(name, set())
        if missing:
            parts = "" if missing == {None} else f" (parts {sorted(map(str, missing))})"
            lacking.append(name + parts)
    if lacking:
        raise ValueError(f"checkpoint {path} lacks weights: {sorted(lacking)}")
