"""Weight-only integer linears (W4A16, W8A16): codes, scales and zero points as a checkpoint
stores them, loaded into the canonical `IntWeight` (quant/int_weight.py) and multiplied by a
kernel that reads the codes (quant/kernels.py picks it per device).

A format (GPTQ, AWQ, compressed-tensors) lists the tensors it stores (`params`): the
parameter's name (the checkpoint's), its row-major shape and dtype, and how a rank's stored
slice becomes its rows (quant/stored.py). Whatever the stored layout, the loaded parameters
hold, under the names `roles` maps:

    codes   [out, in * bits / 8] uint8   (quant/packing.py's canonical packing)
    scales  [out, groups] float32
    zeros   [out, groups] uint8          (asymmetric only; symmetric codes centre on 2^(bits-1))
    g_idx   [in] int32                   (act-order only; the same for every fused part)
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from pagefleet.engine.model.linear import Linear, LinearMethod, LinearSpec, PartReader, rows_loader
from pagefleet.engine.model.quant.int_weight import IntWeight
from pagefleet.engine.model.quant.packing import check_bits
from pagefleet.engine.model.weights import TensorSource, set_check_loader, set_weight_loader


@dataclass(frozen=True)
class IntScheme:
    """What a weight-only integer format quantized: bits, columns per group (None: one group
    per output row), zero points or not, act-order (a group index per input column)."""

    bits: int
    group_size: int | None
    symmetric: bool
    act_order: bool = False

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per channel"
        kind = "symmetric" if self.symmetric else "asymmetric"
        order = ", act-order" if self.act_order else ""
        return f"int{self.bits} {group} {kind}{order}"


@dataclass(frozen=True)
class ParamDef:
    """One stored tensor: its parameter's shape and dtype (shape None: read and checked, not
    kept), its reader, and whether every fused part stores the same tensor (g_idx) rather
    than its own rows."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    read: PartReader
    shared: bool = False


def shared_loader(read: PartReader):
    """A tensor every fused part stores alike (q, k and v share one act-order g_idx): each
    copy must equal the first."""
    filled: set[int] = set()

    def load(param: nn.Parameter, source: TensorSource, part: Hashable) -> None:
        tensor = read(source, part)
        if tensor.shape != param.shape:
            raise ValueError(
                f"{source.name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
            )
        if id(param) in filled and not torch.equal(param.data, tensor.to(param.dtype)):
            raise ValueError(
                f"{source.name} differs from the projections fused with it; they must share "
                "one act-order permutation"
            )
        with torch.no_grad():
            param.data.copy_(tensor)
        filled.add(id(param))

    return load


def check_loader(read: PartReader):
    """A tensor read only to be checked (by `read`)."""

    def load(param, source: TensorSource, part: Hashable) -> None:
        read(source, part)

    return load


class KernelMethod(LinearMethod):
    """A method whose processed layer runs `layer.kernel` (quant/kernels.py's int_kernel over
    the layer's codes): every integer weight-only format, GGUF's included."""

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = layer.kernel(x)
        return y if bias is None else y + bias

    def weight_bytes(self, layer: Linear) -> int:
        kernel = getattr(layer, "kernel", None)
        if kernel is None:
            return super().weight_bytes(layer)
        return sum(t.numel() * t.element_size() for t in kernel.tensors())


class WeightOnlyMethod(KernelMethod):
    """Base of the weight-only integer formats: a subclass sets `scheme`, `roles` (codes,
    scales, zeros, g_idx -> its parameter names) and `params(spec)`."""

    scheme: IntScheme
    roles: ClassVar[dict[str, str]]

    def params(self, spec: LinearSpec) -> dict[str, ParamDef]:
        raise NotImplementedError

    def groups(self, spec: LinearSpec) -> int:
        """Scale groups a rank's layer holds: its columns' groups, or every group of the
        checkpoint under act-order (a rank's columns may belong to any of them)."""
        gs = self.scheme.group_size
        if gs is None:
            return 1
        width = spec.full_in_features if self.scheme.act_order else spec.in_features
        return width // gs

    def check_shape(self, spec: LinearSpec) -> None:
        s = self.scheme
        check_bits(s.bits, self.name)
        gs = s.group_size
        if gs is not None and (gs <= 0 or spec.full_in_features % gs):
            raise ValueError(
                f"group size {gs} does not divide the layer's {spec.full_in_features} input columns"
            )
        if gs is not None and not s.act_order and spec.in_features % gs:
            raise ValueError(
                f"group size {gs} does not divide this rank's {spec.in_features} input columns "
                "(choose another --tensor-parallel-size)"
            )
        if s.bits == 4 and spec.in_features % 2:
            raise ValueError(f"4-bit codes need an even input width, not {spec.in_features}")

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        spec = layer.spec
        self.check_shape(spec)
        for name, d in self.params(spec).items():
            if d.shape is None:
                set_check_loader(layer, name, check_loader(d.read))
                continue
            setattr(layer, name, nn.Parameter(torch.empty(d.shape, dtype=d.dtype), False))
            loader = shared_loader(d.read) if d.shared else rows_loader(spec, d.read)
            set_weight_loader(layer, name, loader, spec.parts)

    def int_weight(self, layer: Linear) -> IntWeight:
        """The loaded parameters as one `IntWeight`."""
        spec, s = layer.spec, self.scheme
        scales = getattr(layer, self.roles["scales"]).data.float()
        zeros = None if s.symmetric else getattr(layer, self.roles["zeros"]).data.float()
        offsets = -(zeros if zeros is not None else float(1 << (s.bits - 1))) * scales
        return IntWeight(
            codes=getattr(layer, self.roles["codes"]).data,
            bits=s.bits,
            scales=scales,
            offsets=offsets,
            group_size=s.group_size or spec.in_features,
            in_features=spec.in_features,
            g_idx=getattr(layer, self.roles["g_idx"]).data if s.act_order else None,
        )

    def process_weights(self, layer: Linear, prepack: bool) -> None:
        from pagefleet.engine.model.quant.kernels import int_kernel

        layer.kernel = int_kernel(self.int_weight(layer))
        for name in [n for n in layer._parameters if n != "bias"]:
            delattr(layer, name)
