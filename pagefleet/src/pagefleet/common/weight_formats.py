"""Weight formats by name, shared by the engine, `pagefleet plan` and the operator (no torch):
vLLM's `--quantization` names, what a checkpoint's config.json says it is quantized with, and
the format its decoder weights take per value for capacity sums (`int4`, `fp8`...).

The engine decides per layer (pagefleet.engine.model.quant); this module only reads the
declaration, so that a plan and an admission check see the format the engine will load.
"""

from __future__ import annotations

from typing import Any

# vLLM's names; the aliases (vLLM's kernel-specific spellings) mean the same format here.
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "awq", "gptq", "gguf")
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors"}


# Not a format: a GGUF file's tensors dequantized into the engine's dtype at load (float
# weights, exact against transformers, which dequantizes GGUF the same way).
DEQUANTIZE = "none"


def canonical_quantization(name: str) -> str:
    """vLLM's name for a --quantization value, or DEQUANTIZE (ValueError naming the supported
    ones)."""
    canonical = ALIASES.get(name, name)
    if canonical not in (*QUANTIZATION_METHODS, DEQUANTIZE):
        raise ValueError(
            f"--quantization {name!r} is not supported; supported: "
            f"{', '.join(QUANTIZATION_METHODS)}, or {DEQUANTIZE} (a GGUF file dequantized)"
        )
    return canonical


def declared_quantization(config: dict[str, Any]) -> str | None:
    """The quant_method a checkpoint's config.json declares (vLLM's spelling), or None."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict) or not isinstance(qc.get("quant_method"), str):
        raise ValueError("config.json quantization_config has no quant_method")
    method = qc["quant_method"].lower()
    return ALIASES.get(method, method)


def quantized_weights_format(config: dict[str, Any]) -> str | None:
    """The per-value format of a quantized checkpoint's decoder linears (`int4`, `int8`,
    `fp8`), as capacity.FORMAT_BYTES names them; None for a float checkpoint or a scheme this
    cannot name (the caller falls back to the dtype)."""
    method = declared_quantization(config)
    qc = config.get("quantization_config") or {}
    if method == "fp8":
        return "fp8"
    if method in ("gptq", "awq"):
        return _int_format(qc.get("bits", qc.get("w_bit", 4)))
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            weights = (group or {}).get("weights") or {}
            if weights.get("type") == "float" and weights.get("num_bits") == 8:
                return "fp8"
            if weights.get("type") == "int":
                return _int_format(weights.get("num_bits"))
    return None


def _int_format(bits: Any) -> str | None:
    return {4: "int4", 8: "int8"}.get(bits if isinstance(bits, int) else None)


def online_weights_format(quantization: str | None) -> str | None:
    """The format a float checkpoint takes under --quantization (fp8 quantizes at load)."""
    return (
        "fp8"
        if quantization is not None and canonical_quantization(quantization) == "fp8"
        else None
    )
