"""The project's reference quantizer: round-to-nearest quantization of a float checkpoint's
decoder linears into each format the engine loads, and the dequantized float checkpoint that
is its oracle (transformers runs it; the engine on the quantized one must agree).

Formats: compressed-tensors W4A16/W8A16 (pack-quantized; per group or channel, symmetric or
not, act-order), FP8 W8A8 (per tensor or channel; dynamic or static activations) and INT8
W8A8; GPTQ (v1 layout, 4/8 bits, act-order); AWQ (GEMM layout); vLLM's serialized FP8. The
LM head and embeddings stay float, as LLM Compressor's recipes leave them. Static activation
scales are calibrated by running the float model (transformers) on a few token ids. Used by
the tests and benchmarks/quantization.py; no kernel or loader depends on it.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet.engine.model.quant.compressed_tensors import matches
from pagefleet.engine.model.quant.packing import AWQ_ORDER, pack_int32

LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


@dataclass(frozen=True)
class Spec:
    """What to write. `kind`: ct-int (weight-only), ct-fp8, ct-int8, gptq, awq, fp8."""

    kind: str
    bits: int = 4
    group_size: int | None = 32  # None: per output channel
    symmetric: bool = True
    act_order: bool = False
    per_channel: bool = True  # 8-bit W8A8: scale per row (else per tensor)
    static: bool = False  # W8A8: static per-tensor input scales
    seed: int = 0
    # compressed-tensors: module patterns (its `ignore` entries) left float
    ignore: tuple[str, ...] = ()


@dataclass
class IntCodes:
    """RTN result: unsigned codes [out, in], scales and zero points [out, groups], g_idx."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor | None
    group_size: int

    def dequantize(self) -> torch.Tensor:
        groups = (
            self.g_idx.long()
            if self.g_idx is not None
            else torch.arange(self.codes.shape[1]) // self.group_size
        )
        return (self.codes.float() - self.zeros[:, groups].float()) * self.scales[:, groups]


def quantize_int(w: torch.Tensor, spec: Spec) -> IntCodes:
    """Round-to-nearest integer codes of `w` [out, in] per group (act-order: groups over a
    seeded permutation of the columns, standing in for GPTQ's activation order)."""
    out, cols = w.shape
    gs = spec.group_size or cols
    g_idx = None
    if spec.act_order:
        perm = torch.randperm(cols, generator=torch.Generator().manual_seed(spec.seed))
        g_idx = torch.empty(cols, dtype=torch.int32)
        g_idx[perm] = (torch.arange(cols) // gs).to(torch.int32)
        groups = g_idx.long()
    else:
        groups = torch.arange(cols) // gs
    n_groups = cols // gs
    top = (1 << spec.bits) - 1
    order = torch.argsort(groups, stable=True)  # each group's columns side by side
    blocks = w[:, order].float().reshape(out, n_groups, gs)
    if spec.symmetric:
        scales = blocks.abs().amax(2) / ((top - 1) / 2)
        zeros = torch.full((out, n_groups), (top + 1) // 2, dtype=torch.int32)
    else:
        lo, hi = blocks.amin(2).clamp(max=0), blocks.amax(2).clamp(min=0)
        scales = (hi - lo) / top
        zeros = torch.round(-lo / scales.clamp(min=1e-12)).clamp(0, top).to(torch.int32)
    scales = scales.clamp(min=1e-12)
    codes = torch.round(w.float() / scales[:, groups]) + zeros[:, groups]
    return IntCodes(codes.clamp(0, top).to(torch.uint8), scales, zeros, g_idx, gs)


def _w8(w: torch.Tensor, spec: Spec, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes and their scale ([out, 1] per channel, [1] per tensor)."""
    top = FP8_MAX if fp8 else 127.0
    amax = w.abs().amax(1, keepdim=True) if spec.per_channel else w.abs().amax().reshape(1)
    scale = (amax.float() / top).clamp(min=1e-12)
    shaped = scale if spec.per_channel else scale.reshape(1, 1)
    if fp8:
        codes = (w.float() / shaped).clamp(-top, top).to(FP8)
    else:
        codes = torch.round(w.float() / shaped).clamp(-128, 127).to(torch.int8)
    return codes, scale


def _dequant_w8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale if scale.dim() == 2 else scale.reshape(1, 1)
    return codes.float() * s


def _int_tensors(prefix: str, q: IntCodes, spec: Spec) -> dict[str, torch.Tensor]:
    """One linear's stored tensors in `spec.kind`'s layout."""
    b = spec.bits
    if spec.kind == "ct-int":
        out = {
            f"{prefix}.weight_packed": pack_int32(q.codes, b, dim=1),
            f"{prefix}.weight_scale": q.scales.clone(),
            f"{prefix}.weight_shape": torch.tensor(list(q.codes.shape), dtype=torch.int64),
        }
        if not spec.symmetric:
            out[f"{prefix}.weight_zero_point"] = pack_int32(q.zeros, b, dim=0)
        if spec.act_order:
            out[f"{prefix}.weight_g_idx"] = q.g_idx
        return out
    if spec.kind == "gptq":
        k = q.codes.shape[1]
        g_idx = q.g_idx if q.g_idx is not None else (torch.arange(k) // q.group_size).int()
        return {
            f"{prefix}.qweight": pack_int32(q.codes.t(), b, dim=0),
            f"{prefix}.qzeros": pack_int32(((q.zeros - 1) & ((1 << b) - 1)).t(), b, dim=1),
            f"{prefix}.scales": q.scales.t().contiguous().half(),
            f"{prefix}.g_idx": g_idx.to(torch.int32),
        }
    if spec.kind == "awq":
        return {
            f"{prefix}.qweight": pack_int32(q.codes.t(), 4, dim=1, order=AWQ_ORDER),
            f"{prefix}.qzeros": pack_int32(q.zeros.t(), 4, dim=1, order=AWQ_ORDER),
            f"{prefix}.scales": q.scales.t().contiguous().half(),
        }
    raise ValueError(f"unknown integer kind {spec.kind!r}")


def quantization_config(spec: Spec) -> dict:
    """The config.json `quantization_config` the writers of `spec.kind` put there."""
    if spec.kind == "gptq":
        return {
            "quant_method": "gptq",
            "bits": spec.bits,
            "group_size": spec.group_size or -1,
            "desc_act": spec.act_order,
            "sym": spec.symmetric,
            "checkpoint_format": "gptq",
        }
    if spec.kind == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": spec.group_size,
            "zero_point": True,
            "version": "gemm",
        }
    if spec.kind == "fp8":
        scheme = "static" if spec.static else "dynamic"
        return {"quant_method": "fp8", "activation_scheme": scheme}
    return _ct_config(spec)


def _ct_config(spec: Spec) -> dict:
    if spec.kind == "ct-int":
        weights = {
            "num_bits": spec.bits,
            "type": "int",
            "symmetric": spec.symmetric,
            "strategy": "group" if spec.group_size else "channel",
            "group_size": spec.group_size,
            "actorder": "group" if spec.act_order else None,
            "dynamic": False,
        }
        acts, fmt = None, "pack-quantized"
    else:
        fp8 = spec.kind == "ct-fp8"
        weights = {
            "num_bits": 8,
            "type": "float" if fp8 else "int",
            "symmetric": True,
            "strategy": "channel" if spec.per_channel else "tensor",
            "dynamic": False,
        }
        acts = {
            "num_bits": 8,
            "type": "float" if fp8 else "int",
            "symmetric": True,
            "strategy": "tensor" if spec.static else "token",
            "dynamic": not spec.static,
        }
        fmt = "float-quantized" if fp8 else "int-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ["lm_head", *spec.ignore],
        "kv_cache_scheme": None,
    }


def calibrate(src: Path, token_ids: list[int]) -> dict[str, float]:
    """The largest input magnitude each decoder linear sees on `token_ids` (float model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    seen: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and LINEAR.match(name + ".weight"):

            def hook(mod, args, out, name=name):
                seen[name] = max(seen.get(name, 0.0), float(args[0].abs().max()))

            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor([token_ids]))
    for h in hooks:
        h.remove()
    return seen


def write_quantized(
    src: str | Path,
    dest: str | Path,
    spec: Spec,
    oracle: str | Path | None = None,
    calibration: list[int] | None = None,
) -> Path:
    """Quantize the float checkpoint `src` into `dest` as `spec` says; with `oracle`, also
    write the dequantized float checkpoint there (same config, no quantization_config)."""
    from safetensors.torch import load_file, save_file

    src, dest = Path(src), Path(dest)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    amax = calibrate(src, calibration or list(range(1, 33))) if spec.static else {}
    stored, dequantized = {}, {}
    for name, w in tensors.items():
        if not LINEAR.match(name):
            stored[name] = dequantized[name] = w
            continue
        prefix = name.removesuffix(".weight")
        if any(matches(pattern, prefix) for pattern in spec.ignore):
            stored[name] = dequantized[name] = w
            continue
        if spec.kind in ("ct-int", "gptq", "awq"):
            q = quantize_int(w, spec)
            if spec.kind in ("gptq", "awq"):  # they store float16 scales: the oracle too
                q.scales = q.scales.half().float()
            stored.update(_int_tensors(prefix, q, spec))
            dequantized[name] = q.dequantize().to(w.dtype)
            continue
        fp8 = spec.kind in ("ct-fp8", "fp8")
        codes, scale = _w8(w, spec if spec.kind != "fp8" else Spec("fp8", per_channel=False), fp8)
        stored[name], stored[f"{prefix}.weight_scale"] = codes, scale
        if spec.static:
            top = FP8_MAX if fp8 else 127.0
            stored[f"{prefix}.input_scale"] = torch.tensor([amax[prefix] / top])
        dequantized[name] = _dequant_w8(codes, scale).to(w.dtype)
    _write(src, dest, stored, quantization_config(spec), save_file)
    if oracle is not None:
        _write(src, Path(oracle), dequantized, None, save_file)
    return dest


def _write(src: Path, dest: Path, tensors: dict, qc: dict | None, save_file) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.suffix == ".safetensors" or item.name in ("config.json",) or item.is_dir():
            continue
        if item.name != "model.safetensors.index.json":
            shutil.copy(item, dest / item.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if qc is not None:
        config["quantization_config"] = qc
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dest / "model.safetensors")
