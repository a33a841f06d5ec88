"""Linear layers on oneDNN-prepacked weights: the CPU float32 path of the model's matmuls.

Torch's plain CPU float32 linear goes to MKL's sgemm, which on this class of machine (AMD EPYC
with AVX-512) ran the model's shapes at ~80-100 GFLOP/s on one core; oneDNN's JIT kernels on a
weight reordered once into its blocked layout ran them at ~190-240 from 8 rows up, and about
even at 1 row (benchmarks/cpu_linear.py); on an Intel Xeon they lost at 1 row, so which
shapes are packed is chosen per machine (model/linear_plan.py, `--linear-path`). The float
linear method (model/linear.py) reorders a chosen weight after loading and releases the plain
one, so memory stays the same except for a
tied LM head, whose packed copy sits beside the embedding. The families' plain `nn.Linear`
children outside that seam (a MoE router's gate, a linear-attention layer's projections) are
swapped for `PackedLinear` by `pack_children`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing is used for float32 on CPU only (GPUs have their own GEMMs; the bf16 CPU
    path was not measured)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The (out, in) weight in oneDNN's blocked layout (an opaque mkldnn tensor), for any
    number of input rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear_add(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """residual + (x W^T + b) in one pass: oneDNN adds the residual as the GEMM writes its
    output, so the projection's own output is never materialised."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")


def plain_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch's linear on the plain weight (MKL's sgemv at one row), added into `residual`."""
    out = F.linear(x, weight, bias)
    return out if residual is None else residual.add_(out)


class PackedLinear(nn.Module):
    """y = x W^T + b on a prepacked W; replaces an `nn.Linear` after its weights are loaded."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return packed_linear_add(x, self.packed, self.bias, residual)


def pack_children(module: nn.Module, names: tuple[str, ...]) -> None:
    """Replace each named `nn.Linear` child by its packed form; other kinds (the linear seam's
    layers) pack themselves through their own `prepack`."""
    for name in names:
        child = getattr(module, name)
        if type(child) is nn.Linear:
            setattr(module, name, PackedLinear(child))
        elif hasattr(child, "prepack"):
            child.prepack()


def shard_linear(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None):
    """x W^T with whichever form of W a layer holds (plain before `prepack`, packed after)."""
    if packed is not None:
        return packed_linear(x, packed)
    return F.linear(x, weight)
