"""Which quantization a checkpoint is served with, and which linear method each layer gets.

`--quantization` takes vLLM's names. Unset, the checkpoint's `quantization_config` decides, as
in vLLM; set, it must agree with it (a flag and a checkpoint that disagree, or a scheme that is
not served, are one error naming both). `fp8` on a float checkpoint quantizes it at load.

A format answers `method_for(module)` for each of the checkpoint's linear modules (HF names:
`model.layers.0.self_attn.q_proj`, `lm_head`; None keeps it float) and `summary()` for the
startup log; `choose_methods` maps our fused layers onto those names, so q, k and v must agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pagefleet.common.gguf_file import is_gguf
from pagefleet.common.weight_formats import (
    DEQUANTIZE,
    QUANTIZATION_METHODS,
    canonical_quantization,
    declared_quantization,
    online_weights_format,
    quantized_weights_format,
)
from pagefleet.engine.model.linear import Linear, LinearMethod, set_methods


class QuantFormat(Protocol):
    name: str

    def method_for(self, module: str) -> LinearMethod | None: ...

    def summary(self) -> str: ...


@dataclass(frozen=True)
class UniformFormat:
    """Every linear but the LM head (and any in `skip`) gets one method: GPTQ, AWQ, online
    and serialized FP8."""

    name: str
    method: LinearMethod
    describe: str
    skip: tuple[str, ...] = ()
    quantize_lm_head: bool = False

    def method_for(self, module: str) -> LinearMethod | None:
        if module == "lm_head" and not self.quantize_lm_head:
            return None
        if any(s in module for s in self.skip):  # transformers' rule for these lists
            return None
        return self.method

    def summary(self) -> str:
        return f"{self.name}: {self.describe}"


def resolve_quantization(flag: str | None, hf_config: dict, path) -> QuantFormat | None:
    """The format to serve the checkpoint at `path` with (None: float weights)."""
    stored = "gguf" if is_gguf(path) else declared_quantization(hf_config)
    wanted = canonical_quantization(flag) if flag is not None else stored
    if wanted == DEQUANTIZE and stored not in (None, "gguf"):
        raise ValueError(
            f"--quantization {DEQUANTIZE} dequantizes a GGUF file at load; {path} is quantized "
            f"as {stored}: serve it as stored (drop the flag)"
        )
    if wanted in (None, DEQUANTIZE):
        return None
    if stored == "gguf" and wanted == "gguf":
        from pagefleet.engine.model.quant.gguf import format_of

        return format_of(path)
    if stored is None:
        if wanted == "fp8":
            from pagefleet.engine.model.quant.scaled8 import Scaled8Method

            method = Scaled8Method(fp8=True, online=True)
            return UniformFormat("fp8", method, "FP8 e4m3 per-channel, quantized at load")
        what = "a GGUF file" if wanted == "gguf" else f"a checkpoint quantized as {wanted}"
        raise ValueError(
            f"--quantization {flag} needs {what}; {path} has no quantization_config (a float "
            "checkpoint: only fp8 quantizes at load)"
        )
    if wanted != stored:
        declared = (
            "is a GGUF file"
            if stored == "gguf"
            else (f"whose quantization_config says quant_method {stored!r}")
        )
        raise ValueError(
            f"--quantization {flag} disagrees with the checkpoint {path}, which {declared}: "
            f"drop the flag or pass --quantization {stored}"
        )
    if stored not in FORMATS:
        raise ValueError(
            f"the checkpoint {path} is quantized with {stored!r}, which is not supported; "
            f"supported: {', '.join(QUANTIZATION_METHODS)}"
        )
    return FORMATS[stored](hf_config["quantization_config"])


def _gptq(qc: dict) -> QuantFormat:
    from pagefleet.engine.model.quant.gptq import method_of

    method = method_of(qc)
    return UniformFormat("gptq", method, method.scheme.describe(), (), bool(qc.get("lm_head")))


def _awq(qc: dict) -> QuantFormat:
    from pagefleet.engine.model.quant.awq import method_of

    method = method_of(qc)
    skip = tuple(qc.get("modules_to_not_convert") or ())
    return UniformFormat("awq", method, method.scheme.describe(), skip)


def _compressed_tensors(qc: dict) -> QuantFormat:
    from pagefleet.engine.model.quant.compressed_tensors import format_of

    return format_of(qc)


def _fp8(qc: dict) -> QuantFormat:
    """vLLM's serialized FP8 (`quant_method: fp8`): e4m3 weights with a scale per tensor."""
    from pagefleet.engine.model.quant.scaled8 import Scaled8Method

    if qc.get("weight_block_size"):
        raise ValueError(
            f"fp8 with weight_block_size {qc['weight_block_size']} (block-wise scales) is not "
            "supported; per-tensor and per-channel scales are"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (dynamic, static)")
    method = Scaled8Method(fp8=True, static_input=scheme == "static")
    skip = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    return UniformFormat("fp8", method, f"FP8 e4m3, {scheme} activations", skip)


FORMATS: dict[str, Callable[[dict], QuantFormat]] = {
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _compressed_tensors,
    "fp8": _fp8,
}


def choose_methods(model, fmt: QuantFormat, dtype: torch.dtype) -> None:
    """Give each linear layer of `model` (a CausalLM) its method under `fmt`: the method of
    the checkpoint modules fused into it, which must agree."""

    fused = getattr(fmt, "method_for_layer", None)  # a format that merges fused parts

    def choose(name: str, layer: Linear) -> LinearMethod | None:
        modules = model.checkpoint_modules(name, list(layer.spec.parts))
        if fused is not None:
            return fused(modules)
        methods = {m: fmt.method_for(m) for m in modules}
        if len(set(methods.values())) > 1:
            listed = ", ".join(f"{m}: {_label(x)}" for m, x in methods.items())
            raise ValueError(
                f"{fmt.name}: the projections fused into {name} are quantized differently "
                f"({listed}); they must share one scheme"
            )
        return next(iter(methods.values()))

    set_methods(model, choose, dtype)


def _label(method: LinearMethod | None) -> str:
    return "float" if method is None else method.name


def weights_label(quant: QuantFormat | None, hf_config: dict, flag: str | None, dtype) -> str:
    """The weights' format as the capacity module names it (int4, fp8, gguf... or the
    dtype), for the startup log and the engine's plan."""
    if quant is not None and quant.name == "gguf":
        return "gguf"
    return (
        quantized_weights_format(hf_config)
        or online_weights_format(flag)
        or str(dtype).removeprefix("torch.")
    )
