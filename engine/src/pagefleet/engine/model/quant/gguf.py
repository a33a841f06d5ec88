"""GGUF linears kept quantized: each tensor's blocks become the canonical integer codes with
a scale and an offset per sub-block (model/ggml_quants.py's `block_codes`: value = code *
scale + offset), exactly, and run on the weight-only kernels (quant/kernels.py). A 4-bit file
stays 4 bits in memory; the embedding is dequantized at load as before (model/gguf.py).

Types: Q4_0, Q4_1, Q4_K as 4-bit codes in groups of 32; Q8_0, Q5_K as 8-bit codes in groups
of 32; Q6_K as 8-bit codes in groups of 16 (which the CPU kernel, whose groups start at 32,
pads: twice Q6_K's codes). A fused layer whose projections differ (a Q4_K_M file's Q6_K
attn_v beside Q4_K q and k) takes the wider codes and the smaller group; a float projection
(F32/F16/BF16) keeps the whole layer float.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagefleet.engine.model.ggml_quants import CODED_TYPES, block_codes, block_geometry
from pagefleet.engine.model.linear import Linear, LinearMethod, rows_loader
from pagefleet.engine.model.quant.int_weight import IntWeight
from pagefleet.engine.model.quant.packing import pack_codes
from pagefleet.engine.model.weights import TensorSource, set_weight_loader

NAME = "gguf"
# A coded type's (bits its codes are kept in, values per scale).
LAYOUT = {
    GGMLQuantizationType.Q4_0: (4, 32),
    GGMLQuantizationType.Q4_1: (4, 32),
    GGMLQuantizationType.Q4_K: (4, 32),
    GGMLQuantizationType.Q8_0: (8, 32),
    GGMLQuantizationType.Q5_K: (8, 32),
    GGMLQuantizationType.Q6_K: (8, 16),
}


@dataclass(frozen=True)
class GgufMethod(LinearMethod):
    """Codes of `bits` (4: two per byte) with a scale and an offset per `group` columns."""

    bits: int
    group: int

    name = NAME

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        spec = layer.spec
        n, k = spec.out_features, spec.in_features
        if k % self.group:
            raise ValueError(f"{k} input columns do not split into GGUF groups of {self.group}")
        layer.weight = nn.Parameter(torch.empty(n, k * self.bits // 8, dtype=torch.uint8), False)
        layer.register_buffer("code_scales", torch.empty(n, k // self.group), persistent=False)
        layer.register_buffer("code_offsets", torch.empty(n, k // self.group), persistent=False)
        offsets = spec.offsets()

        def read(source: TensorSource, part: Hashable) -> torch.Tensor:
            codes, scales, offs = _decode(source, spec.part_rows(part), spec.cols, self.group)
            at = offsets[part]
            layer.code_scales[at : at + codes.shape[0]] = scales
            layer.code_offsets[at : at + codes.shape[0]] = offs
            return pack_codes(codes, self.bits)

        set_weight_loader(layer, "weight", rows_loader(spec, read), spec.parts)

    def process_weights(self, layer: Linear, prepack: bool) -> None:
        from pagefleet.engine.model.quant.kernels import int_kernel

        spec = layer.spec
        weight = IntWeight(
            codes=layer.weight.data,
            bits=self.bits,
            scales=layer.code_scales,
            offsets=layer.code_offsets,
            group_size=self.group,
            in_features=spec.in_features,
        )
        layer.kernel = int_kernel(weight)
        layer.weight = None
        del layer.code_scales, layer.code_offsets

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = layer.kernel(x)
        return y if bias is None else y + bias

    def weight_bytes(self, layer: Linear) -> int:
        kernel = getattr(layer, "kernel", None)
        if kernel is None:
            return super().weight_bytes(layer)
        return sum(t.numel() * t.element_size() for t in kernel.tensors())


def _decode(source, rows, cols, group: int):
    """This rank's rows and columns of a GGUF tensor as (codes [rows, cols] uint8, scales and
    offsets [rows, cols / group]), llama's rotary rows put back in HF's order."""
    ggml_type = source.ggml_type
    if ggml_type not in CODED_TYPES:
        raise ValueError(f"{source.name}: ggml type {ggml_type.name} is not a coded type")
    values, nbytes = block_geometry(ggml_type)
    out, width = source.shape
    raw = source.raw().reshape(out, width // values, nbytes)
    if cols is not None:
        if cols.start % values or cols.length % values:
            raise ValueError(
                f"{source.name}: this rank's input columns {cols.start}..{cols.start + cols.length}"
                f" split {ggml_type.name} blocks of {values}; choose a --tensor-parallel-size "
                "that does not"
            )
        raw = raw[:, cols.start // values : (cols.start + cols.length) // values]
    blocks = block_codes(raw.reshape(-1, nbytes), ggml_type)
    repeat = blocks.group // group  # a coarser type's scale serves each finer group
    codes = blocks.codes.reshape(out, -1)
    scales = blocks.scales.reshape(out, -1).repeat_interleave(repeat, dim=1)
    offs = blocks.offsets.reshape(out, -1).repeat_interleave(repeat, dim=1)
    if source.rotary_heads is not None:
        from pagefleet.engine.model.gguf import undo_rotary_interleave

        codes, scales, offs = (
            undo_rotary_interleave(t, source.rotary_heads) for t in (codes, scales, offs)
        )
    if rows is not None:
        codes, scales, offs = (t.narrow(0, rows.start, rows.length) for t in (codes, scales, offs))
    return codes, scales, offs


@dataclass(frozen=True)
class GgufFormat:
    """The methods a GGUF file's tensor types give its linears (`types`: HF module name ->
    ggml type)."""

    types: dict[str, GGMLQuantizationType]

    name = NAME

    def method_for(self, module: str) -> LinearMethod | None:
        return self.method_for_layer([module])

    def method_for_layer(self, modules: list[str]) -> LinearMethod | None:
        """One method for projections fused into one layer: the widest codes and the finest
        group of theirs; float if any is float."""
        layouts = [LAYOUT.get(self.types.get(m)) for m in modules]
        if any(layout is None for layout in layouts):
            return None
        return GgufMethod(max(b for b, _ in layouts), min(g for _, g in layouts))

    def summary(self) -> str:
        kinds = sorted({t.name for t in self.types.values() if t in LAYOUT})
        return f"gguf: {', '.join(kinds)} kept as codes"


def format_of(path) -> GgufFormat:
    from pagefleet.engine.model.gguf import tensor_types

    types = {name.removesuffix(".weight"): t for name, t in tensor_types(path).items()}
    return GgufFormat(types)
