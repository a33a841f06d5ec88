"""FP8 (e4m3) KV cache: the `--kv-cache-dtype` values, per-layer scales read from the
checkpoint, and saturating quantisation for the torch backend (the Triton kernels do the same
arithmetic in their own loads and stores).

A stored value is x / scale clamped to +-448 and rounded to e4m3 (e4m3fn has no infinity; the
clamp is explicit so saturation does not depend on how a backend's cast treats out-of-range
values); it is read back as value x scale. Scales are 1.0 unless the checkpoint carries
calibrated ones, under vLLM's names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet.engine.config import FP8_KV_CACHE_DTYPES

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448

# vLLM's checkpoint names of KV scales: `layers.N.self_attn.k_scale` / `v_scale` (also under
# `.attn.`), the deprecated `kv_scale` (one scale for both), and ModelOpt's
# `k_proj.output_scale` / `v_proj.output_scale`.
_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\."
    r"(?:(?:attn\.)?(?P<which>k|v|kv)_scale|(?P<proj>k|v)_proj\.output_scale)$"
)

# Per layer (k_scale, v_scale); None for a cache that holds values as they are.
LayerScales = tuple[float, float]


def is_fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in FP8_KV_CACHE_DTYPES


def check_fp8_backend(backend: str, capability: tuple[int, int] | None) -> None:
    """Refuse, at start-up, an fp8 cache the attention kernels cannot run: Triton compiles
    e4m3 (its fp8e4nv) only for compute capability 8.9 and up (Ada, Hopper, Blackwell), so an
    A100 or A10G would fail at its first step. `capability`: the CUDA device's, None on CPU."""
    if backend == "triton" and capability is not None and capability < (8, 9):
        major, minor = capability
        raise ValueError(
            f"--kv-cache-dtype fp8 on the Triton attention backend needs a GPU of compute "
            f"capability 8.9 or more (this one is {major}.{minor}): use --attention-backend "
            "torch, or a 16-bit KV cache"
        )


def is_kv_scale(name: str) -> bool:
    """Whether a checkpoint tensor is a KV-cache scale (the cache's, not a model weight)."""
    return _SCALE_NAME.search(name) is not None


@dataclass(frozen=True)
class ScaleEntry:
    layer: int
    which: str  # "k", "v" or "kv" (both)


def parse_scale_name(name: str) -> ScaleEntry | None:
    found = _SCALE_NAME.search(name)
    if found is None:
        return None
    return ScaleEntry(int(found.group(1)), found.group("which") or found.group("proj"))


def scales_from_entries(
    entries: Iterable[tuple[str, float]], num_layers: int, source: str = "checkpoint"
) -> list[LayerScales]:
    """Per layer (k_scale, v_scale) from (tensor name, value) pairs; 1.0 where none is given.
    A scale that is not a positive finite number, or names a layer the model lacks, is refused
    (it would silently corrupt every value of its layer)."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    for name, value in entries:
        entry = parse_scale_name(name)
        if entry is None:
            continue
        if not 0 <= entry.layer < num_layers or not 0 < value < float("inf"):
            raise ValueError(f"{source}: {name}={value} is not a usable KV-cache scale")
        if entry.which in ("k", "kv"):
            scales[entry.layer][0] = value
        if entry.which in ("v", "kv"):
            scales[entry.layer][1] = value
    return [(k, v) for k, v in scales]


def read_kv_scales(files: list[Path], num_layers: int) -> list[LayerScales]:
    """Per layer (k_scale, v_scale) from safetensors files (vLLM's names; 1.0 if absent)."""
    from safetensors import safe_open

    entries: list[tuple[str, float]] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if is_kv_scale(name):
                    # A scale is a scalar (or a one-element tensor): per-tensor, as vLLM's.
                    entries.append((name, float(f.get_tensor(name).float().reshape(-1)[0])))
    return scales_from_entries(entries, num_layers, files[0].parent.name if files else "")


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3, saturated at +-448."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 values x scale, in `dtype`."""
    if x.device.type != "cpu":
        out = x.to(dtype)
        return out.mul_(scale) if scale != 1.0 else out
    return _e4m3_bits_as_half(x).to(dtype).mul_(scale * _HALF_TO_E4M3)


# e4m3fn bits moved into a float16's place (sign to bit 15, exponent and mantissa under it)
# read 2^8 smaller: e4m3's exponent bias is 7, float16's 15; e4m3's subnormals land on float16
# subnormals, so every finite code is exact (tests/test_fp8_kv_cache.py checks all 254).
_HALF_TO_E4M3 = 256.0


def _e4m3_bits_as_half(x: torch.Tensor) -> torch.Tensor:
    """CPU torch converts float8 one element at a time (~3 ns each, 50x a bfloat16 cast: most
    of an fp8 decode step); these four vectorised integer ops take a sixth of that."""
    bits = x.view(torch.uint8).to(torch.int16)
    return (((bits & 0x7F) << 7) | ((bits & 0x80) << 8)).view(torch.float16)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache.index_select(1, block_ids); CPU torch has no float8 index_select, so its bytes
    move instead (the same bits)."""
    if cache.dtype == FP8_KV_DTYPE:
        return cache.view(torch.uint8).index_select(1, block_ids).view(FP8_KV_DTYPE)
    return cache.index_select(1, block_ids)


def scatter_slots(flat_cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """flat_cache.index_copy_(1, slots, values) for a cache of any dtype (float8 as bytes)."""
    if flat_cache.dtype == FP8_KV_DTYPE:
        flat_cache, values = flat_cache.view(torch.uint8), values.view(torch.uint8)
    flat_cache.index_copy_(1, slots, values)
