"""Rotary position embeddings (half-rotation layout, as HF's Llama/Qwen), with llama3 scaling and
partial rotation (`partial_rotary_factor`: only a head's leading dims rotate, as in Qwen3.5)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_params(config: dict) -> dict:
    """The rope settings of a config.json, old style (rope_theta + rope_scaling) or new
    (rope_parameters), as one dict with `rope_type` and `rope_theta`."""
    params = dict(config.get("rope_parameters") or {})
    if not params:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {params['rope_type']!r} is not supported; one of {SUPPORTED_ROPE_TYPES}"
        )
    return params


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    kind = params["rope_type"]
    if kind == "linear":
        inv_freq = inv_freq / params["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, params)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are slowed by `factor`, short
    ones kept, and the band between them blended linearly in 1/wavelength."""
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    original_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original_len / low
    short_wave = wavelen < original_len / high
    blend = (original_len / wavelen - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    return torch.where(~long_wave & ~short_wave, blended, scaled)


def rotary_dim(head_dim: int, params: dict) -> int:
    """Leading dims of a head that rotate (the rest pass through), as HF rounds it."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin per position (buffers, no forward). `at(positions)` looks a step's
    rows up once for all its layers; the `Rotation` it returns rotates flattened
    [tokens, heads, head_dim]."""

    def __init__(self, head_dim: int, max_positions: int, params: dict) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rotary_dim(head_dim, params), params)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [positions, rotary/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """HF's form, x * cos + rotate_half(x) * sin, with the step's rows widened to the
        rotary dims and rotate_half's minus sign folded into the first half of `sin`: a
        rotation is then a swap of the halves, two products and a sum, bit for bit the same
        values. (Widened per step, not in the table: a long context's table stays half.)"""
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, rotary/2]
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return Rotation(cos, sin)


@dataclass(frozen=True)
class Rotation:
    """The rotary rows of one step's tokens (what a decoder layer's `rope` is): `[T, 1,
    rotary_dim]`; a head's dims past them pass through (partial rotation)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dtype == torch.float32 and q.device.type == "cpu":
            from pagefleet.engine.model import numba_ops  # where a float32 CPU step needs it

            if numba_ops.rotation_applies(q, k, self.cos):
                return numba_ops.rotate(q, k, self.cos, self.sin)
        return self.rotate(q), self.rotate(k)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        rotary, head = self.cos.shape[-1], x.shape[-1]
        if rotary == head:
            return _rotate(x, self.cos, self.sin)
        rotated, passed = x.split([rotary, head - rotary], dim=-1)
        return torch.cat((_rotate(rotated, self.cos, self.sin), passed), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return swapped.mul_(sin).add_(x * cos)
