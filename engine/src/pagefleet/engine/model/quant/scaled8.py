"""8-bit weights with 8-bit activations (W8A8): FP8 (e4m3) and INT8 checkpoints, and FP8
quantized at load from a float checkpoint (`--quantization fp8`, per-channel scales).

Weights are stored `[out, in]` in 8 bits with a scale per tensor or per output row (a
per-tensor scale is kept per row, so fused projections keep their own); activations get a
scale per token at run time (dynamic), or the checkpoint's per-tensor `input_scale` (static;
fused projections share the largest of theirs, as vLLM does).

Kernels (quant/kernels.py): FP8 runs `torch._scaled_mm` on GPUs of compute capability 8.9 and
above and is refused below (no FP8 tensor cores). CPUs have no FP8 GEMM (torch's `_scaled_mm`
on CPU measured 30-500x slower than float32), so there an FP8 weight is requantized once to
INT8 per output row and runs as INT8 W8A8: the same bytes, and its rounding (half an int8
step of the row's largest value) is well under FP8's own (an eighth of each value's octave).
INT8 W8A8 runs `torch._int_mm` (int8 x int8 -> int32) on both.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import nn

from pagefleet.engine.model.linear import (
    Linear,
    LinearMethod,
    LinearSpec,
    read_float_part,
    rows_loader,
)
from pagefleet.engine.model.quant.stored import Stored, read_stored
from pagefleet.engine.model.weights import TensorSource, set_weight_loader

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


def _per_row_scale(spec: LinearSpec):
    """A scale stored per tensor (`[]`, `[1]`) or per output row (`[rows, 1]`, `[rows]`) ->
    one per row of the part on this rank."""

    def read(source: TensorSource, part: Hashable) -> torch.Tensor:
        if math.prod(source.shape) == 1:
            return source.read().float().reshape(1).expand(spec.parts[part]).clone()
        rows = read_stored(source, Stored(out_dim=0), spec.part_rows(part), None)
        return rows.float().reshape(-1)

    return read


def _input_scale_loader(spec: LinearSpec):
    """Each part's static per-tensor input scale into its slot."""
    slots = {part: i for i, part in enumerate(spec.parts)}

    def load(param: nn.Parameter, source: TensorSource, part: Hashable) -> None:
        value = source.read().float().reshape(-1)
        if value.numel() != 1:
            raise ValueError(
                f"{source.name}: a static input scale must be one value per tensor, not "
                f"{value.numel()}"
            )
        with torch.no_grad():
            param.data[slots[part]] = value[0]

    return load


@dataclass(frozen=True)
class Scaled8Method(LinearMethod):
    """W8A8 with a weight scale per row. `fp8`: e4m3 weights (else int8); `static_input`: the
    checkpoint holds `input_scale`; `online`: the checkpoint is float and is quantized to FP8
    at load."""

    fp8: bool
    static_input: bool = False
    online: bool = False

    @property
    def name(self) -> str:
        kind = "fp8" if self.fp8 else "int8"
        return f"{kind} w8a8" + (" (online)" if self.online else "")

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        spec = layer.spec
        n, k = spec.out_features, spec.in_features
        if self.online:
            layer.weight = nn.Parameter(torch.empty(n, k, dtype=dtype), False)
            set_weight_loader(layer, "weight", rows_loader(spec, read_float_part(spec)), spec.parts)
            return
        stored = FP8_DTYPE if self.fp8 else torch.int8
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=stored), False)
        set_weight_loader(layer, "weight", rows_loader(spec, read_float_part(spec)), spec.parts)
        layer.weight_scale = nn.Parameter(torch.empty(n, dtype=torch.float32), False)
        set_weight_loader(
            layer, "weight_scale", rows_loader(spec, _per_row_scale(spec)), spec.parts
        )
        if self.static_input:
            layer.input_scale = nn.Parameter(torch.empty(len(spec.parts)), False)
            set_weight_loader(layer, "input_scale", _input_scale_loader(spec), spec.parts)

    def process_weights(self, layer: Linear, prepack: bool) -> None:
        from pagefleet.engine.model.quant.kernels import scaled8_kernel

        if self.online:
            weight, scale = quantize_fp8_per_row(layer.weight.data)
        else:
            weight, scale = layer.weight.data, layer.weight_scale.data
        input_scale = None
        if self.static_input:
            input_scale = float(layer.input_scale.data.max())
        layer.kernel = scaled8_kernel(weight, scale, input_scale)
        for name in [n for n in layer._parameters if n != "bias"]:
            delattr(layer, name)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.kernel(x, bias)

    def weight_bytes(self, layer: Linear) -> int:
        kernel = getattr(layer, "kernel", None)
        if kernel is None:
            return super().weight_bytes(layer)
        return sum(t.numel() * t.element_size() for t in kernel.tensors())


def quantize_fp8_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 codes and a float32 scale per output row: each row's largest magnitude maps
    to e4m3's largest value (448)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale
