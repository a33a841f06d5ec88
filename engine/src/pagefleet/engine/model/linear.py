"""Linear layers and the weight-format methods behind them: the one seam through which a
weight format (float, FP8, INT8, INT4 GPTQ/AWQ/compressed-tensors, GGUF) reaches a layer, as
vLLM's `LinearMethodBase` does.

A `Linear` knows its shape on this rank (`LinearSpec`: input columns, the output rows of each
checkpoint projection fused into it, which rows and columns of the checkpoint's tensors this
rank reads) and holds a `LinearMethod` that owns its weights:

- `create_weights(layer, dtype)` registers the parameters the format stores, named as the
  checkpoint names them (`qweight`, `scales`, `weight_scale`...: `model.layers.0.mlp.down_proj.
  qweight` then finds `layers.0.mlp.gate_up_proj`... through the model's name map) and attaches
  each one's weight loader (model/weights.py), which reads this rank's slice of the stored
  layout (packed int4 columns, scale groups, zero points) into rows `[out, ...]` in the order of
  the fused parts;
- `process_weights(layer, prepack)` runs once after loading: it turns the loaded tensors into
  what its kernel reads (a oneDNN-packed float weight, packed int4 codes, FP8 with scales) and
  drops the rest;
- `apply(layer, x, bias)` is `x W^T (+ bias)`; `apply_add(layer, x, bias, residual)` adds it
  into `residual` (fused where the kernel can);
- `weight_bytes(layer)` is what its weights take after processing.

The layer owns the bias (every format keeps it in the model's dtype) and the reduction across
ranks: `RowParallelLinear` all-reduces partial sums and adds the bias once, `ParallelLMHead`
gathers the vocabulary slices on rank 0. Families build linears through the factories in
model/layers.py with the float method; `set_methods` then gives each linear the method its
checkpoint's quantization chooses for it by name (model/quant/), before any memory is
allocated. A wrapper (a LoRA delta) calls `layer(x)` and reads `layer.spec` for its shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagefleet.engine.model.packed import (
    pack_weight,
    packed_linear,
    packed_linear_add,
    plain_linear,
    prepack_supported,
)
from pagefleet.engine.model.weights import (
    Slice,
    TensorSource,
    WeightLoader,
    copy_checked,
    read_piece,
    set_weight_loader,
)


@dataclass(frozen=True)
class LinearSpec:
    """A linear layer's shape on this rank and where its weights come from.

    `parts`: output rows of each checkpoint projection on this rank, in the order they stack
    (a plain linear has one part, None). `rows[part]`: the slice of that projection's
    checkpoint rows this rank reads (None: all of them); a slice shorter than the part's rows
    leaves the rest zero (the padding of the last vocabulary shard). `cols`: the slice of the
    checkpoint's input columns this rank reads (a row-parallel shard), or None; `in_full`: the
    checkpoint's input columns (None: `in_features`, the layer is not split by columns)."""

    in_features: int
    parts: dict[Hashable, int]
    rows: dict[Hashable, Slice | None] = field(default_factory=dict)
    cols: Slice | None = None
    bias: bool = False
    in_full: int | None = None

    @property
    def full_in_features(self) -> int:
        return self.in_features if self.in_full is None else self.in_full

    @property
    def out_features(self) -> int:
        return sum(self.parts.values())

    def offsets(self) -> dict[Hashable, int]:
        """First row of each part in the layer's output."""
        offsets, start = {}, 0
        for part, size in self.parts.items():
            offsets[part] = start
            start += size
        return offsets

    def part_rows(self, part: Hashable) -> Slice | None:
        return self.rows.get(part)


# read(source, part) -> the rank's rows of `part` as the parameter stores them: [rows, ...].
PartReader = Callable[[TensorSource, Hashable], torch.Tensor]


def rows_loader(spec: LinearSpec, read: PartReader) -> WeightLoader:
    """A parameter whose dim 0 stacks the parts' output rows (weights, per-row scales and
    zeros in every format here): each part's tensor, as `read` makes it, fills its rows; rows
    past what the checkpoint has (vocabulary padding) are zeroed."""
    offsets = spec.offsets()

    def load(param: nn.Parameter, source: TensorSource, part: Hashable) -> None:
        if part not in offsets:
            raise ValueError(f"{source.name}: no part {part!r} in this layer")
        dest = param.data.narrow(0, offsets[part], spec.parts[part])
        piece = spec.part_rows(part)
        if piece is not None and piece.length < dest.shape[0]:  # the vocabulary's padding
            with torch.no_grad():
                dest[piece.length :].zero_()
            dest = dest[: piece.length]
        what = source.name if part is None else f"{source.name} (part {part})"
        copy_checked(dest, read(source, part), what)

    return load


def read_float_part(spec: LinearSpec) -> PartReader:
    """A float weight `[out, in]`: this rank's rows of the part, and its columns."""

    def read(source: TensorSource, part: Hashable) -> torch.Tensor:
        rows, cols = spec.part_rows(part), spec.cols
        if rows is not None and cols is not None:
            return read_piece(source, rows).narrow(1, cols.start, cols.length)
        return read_piece(source, rows if rows is not None else cols)

    return read


class LinearMethod:
    """How one weight format stores, loads and multiplies a linear layer's weights (see the
    module docstring). Subclasses define `create_weights`, `process_weights` and `apply`."""

    name = "abstract"

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights(self, layer: Linear, prepack: bool) -> None:
        raise NotImplementedError

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_add(
        self,
        layer: Linear,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        return residual.add_(self.apply(layer, x, bias))

    def weight_bytes(self, layer: Linear) -> int:
        """Bytes of the weights as processed (parameters and kernel buffers, not the bias)."""
        tensors = [t for n, t in layer.named_parameters(recurse=False) if n != "bias"]
        tensors += list(layer.buffers(recurse=False))
        return sum(t.numel() * t.element_size() for t in tensors)


class FloatLinearMethod(LinearMethod):
    """Weights in the model's dtype. On a float32 CPU model `process_weights` reorders each
    weight once into oneDNN's blocked layout and releases the plain one (model/packed.py),
    unless the plan gives the layer's one-row steps a path on the plain weight
    (`one_row_path`, model/linear_plan.py: "plain" for torch's, "gemv" for numba's): then
    both are kept, the packed one for the steps of several rows."""

    name = "float"

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        spec = layer.spec
        layer.weight = nn.Parameter(
            torch.empty(spec.out_features, spec.in_features, dtype=dtype), requires_grad=False
        )
        set_weight_loader(layer, "weight", rows_loader(spec, read_float_part(spec)), spec.parts)

    def process_weights(self, layer: Linear, prepack: bool) -> None:
        weight = layer.weight
        if weight is None or not prepack_supported(weight.device, weight.dtype):
            return
        if layer.one_row_path == "gemv":
            from pagefleet.engine.model import numba_ops  # compiled with the norms' kernels

            layer.one_row = numba_ops.linear_one_row
        elif layer.one_row_path == "plain":
            layer.one_row = plain_linear
        if prepack:
            layer.register_buffer("packed", pack_weight(weight), persistent=False)
            if layer.one_row is None:
                layer.weight = None  # a tied embedding keeps its own reference

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.one_row is not None and x.dim() == 2 and x.shape[0] == 1:
            return layer.one_row(x, layer.weight, bias)
        packed = getattr(layer, "packed", None)
        if packed is not None:
            return packed_linear(x, packed, bias)
        return F.linear(x, layer.weight, bias)

    def apply_add(self, layer, x, bias, residual):
        if layer.one_row is not None and x.dim() == 2 and x.shape[0] == 1:
            return layer.one_row(x, layer.weight, bias, residual)
        packed = getattr(layer, "packed", None)
        if packed is not None:  # oneDNN adds the residual as the GEMM writes its output
            return packed_linear_add(x, packed, bias, residual)
        return plain_linear(x, layer.weight, bias, residual)


FLOAT = FloatLinearMethod()


class Linear(nn.Module):
    """y = x W^T + b, its weights stored, loaded and multiplied by `method`."""

    def __init__(self, spec: LinearSpec, method: LinearMethod = FLOAT) -> None:
        super().__init__()
        self.spec = spec
        self.in_features, self.out_features = spec.in_features, spec.out_features
        self.bias = (
            nn.Parameter(torch.empty(spec.out_features), requires_grad=False) if spec.bias else None
        )
        if spec.bias:  # the bias is per output row in every format: whole or this rank's rows
            bias_read = read_float_part(LinearSpec(spec.in_features, spec.parts, spec.rows))
            set_weight_loader(self, "bias", rows_loader(spec, bias_read), spec.parts)
        self.processed = False
        # The plan's path for one-row steps (None: the method's own) and the kernel the float
        # method took for it (model/linear_plan.py).
        self.one_row_path: str | None = None
        self.one_row: Callable | None = None
        self.use_method(method, torch.get_default_dtype())

    def use_method(self, method: LinearMethod, dtype: torch.dtype) -> None:
        """Replace the weights by `method`'s (before loading: on the meta device it is free)."""
        for name in [n for n in self._parameters if n != "bias"]:
            delattr(self, name)
        for name in list(self._buffers):
            delattr(self, name)
        loaders = self.__dict__.setdefault("weight_loaders", {})
        for name in [n for n in loaders if n != "bias" or self.bias is None]:
            del loaders[name]
        self.method = method
        method.create_weights(self, dtype)

    def process_weights(self, prepack: bool = True, one_row: str | None = None) -> None:
        """Once, after loading (later calls do nothing); `one_row`: the plan's path for
        one-row steps, "plain" or "gemv" (None: the method's own)."""
        if not self.processed:
            self.one_row_path = one_row
            self.method.process_weights(self, prepack)
            self.processed = True

    def prepack(self) -> None:
        self.process_weights(prepack=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), fused where the method can (the residual's storage is reused)."""
        return self.method.apply_add(self, x, self.bias, residual)

    def weight_bytes(self) -> int:
        return self.method.weight_bytes(self)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, method={self.method.name}"


class RowParallelLinear(Linear):
    """y = all_reduce(x_shard @ W_shard^T) + b: inputs split over ranks, the bias added once."""

    def __init__(self, spec: LinearSpec, group, method: LinearMethod = FLOAT) -> None:
        super().__init__(spec, method)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.method.apply(self, x, None))
        return y if self.bias is None else y + self.bias

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual.add_(self(x))


class ParallelLMHead(Linear):
    """Each rank scores its vocabulary slice; rank 0 gathers the slices (the others get None)."""

    def __init__(self, spec: LinearSpec, vocab_size: int, group, method=FLOAT) -> None:
        super().__init__(spec, method)
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        parts = self.group.gather_to_first(self.method.apply(self, hidden, None))
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def linear_add(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + layer(x), fused where the layer offers it."""
    fused = getattr(layer, "forward_add", None)
    if fused is not None:
        return fused(x, residual)
    return residual.add_(layer(x))


# choose(module name, layer) -> the layer's method, or None to keep the one it has.
MethodChooser = Callable[[str, Linear], LinearMethod | None]


def set_methods(model: nn.Module, choose: MethodChooser, dtype: torch.dtype) -> None:
    """Give every linear layer of `model` the method `choose` picks for it by name."""
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            method = choose(name, module)
            if method is None or method is module.method:
                continue
            try:
                module.use_method(method, dtype)
            except ValueError as e:
                raise ValueError(f"{name} ({method.name}): {e}") from e


def process_weights(
    model: nn.Module,
    prepack: Callable[[tuple[int, int]], bool],
    one_row: Callable[[tuple[int, int]], str | None] = lambda shape: None,
) -> None:
    """After loading: every linear layer's weights into the form its kernel reads;
    `prepack(shape)` says whether a float weight of that (out, in) shape may be packed, and
    `one_row(shape)` what its one-row steps run (Linear.process_weights)."""
    for module in model.modules():
        if isinstance(module, Linear):
            shape = (module.out_features, module.in_features)
            module.process_weights(prepack(shape), one_row(shape))


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take as loaded and processed: each linear's method's count,
    plus every other parameter (embeddings, norms, biases) once, tied ones once."""
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, Linear):
            total += module.weight_bytes()
            seen.update(id(t) for n, t in module.named_parameters(recurse=False) if n != "bias")
    for tensor in model.parameters():  # listed once even where tied
        if id(tensor) not in seen:
            total += tensor.numel() * tensor.element_size()
    return total
