"""How checkpoint tensors reach a model's parameters.

A `TensorSource` is one named tensor in a checkpoint, read lazily: a tensor-parallel rank reads
only its slice (safetensors reads just those bytes). Each parameter has a weight loader, which
the layer that owns it attaches as it builds it (it knows its fused parts and its rank's
slice), as vLLM's layers do: the loader stays generic, and a new layer kind or weight format
brings its own loaders instead of new cases in model/loader.py.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


class TensorSource(Protocol):
    """One checkpoint tensor, not yet read."""

    name: str

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self) -> torch.Tensor: ...

    def read_slice(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) start..start+length only."""
        ...


@dataclass(frozen=True)
class Slice:
    """The part of a checkpoint tensor a rank holds: `length` rows (dim 0) or columns (dim 1)
    from `start`."""

    dim: int
    start: int
    length: int


# loader(param, source, part): copy `source` (or this rank's slice of it) into `param` (or
# the part of it that `part` names: a q/k/v piece of a fused projection, an expert, ...).
# It may return the parts it filled (a tensor of every expert fills many; one of another
# rank's expert none); None means `part`.
WeightLoader = Callable[[nn.Parameter, TensorSource, Hashable], set | None]


@dataclass(frozen=True)
class ParamLoader:
    """How a parameter is filled: its loader, and the parts it needs before it is complete."""

    load: WeightLoader
    parts: frozenset


def set_weight_loader(module: nn.Module, param: str, loader: WeightLoader, parts=(None,)) -> None:
    """Attach `loader` for `module`'s parameter `param` (if it has one: an absent bias is
    skipped), complete once every part in `parts` has arrived. Kept on the module, which
    survives the move off the meta device (parameters are replaced by it)."""
    if getattr(module, param, None) is None:
        return
    loaders = module.__dict__.setdefault("weight_loaders", {})
    loaders[param] = ParamLoader(loader, frozenset(parts))


def set_check_loader(module: nn.Module, name: str, loader: WeightLoader) -> None:
    """Attach a loader for a checkpoint tensor `module` reads and checks but keeps no
    parameter for (a quantized weight's stored shape): it gets None for the parameter, and
    the tensor is never required."""
    module.__dict__.setdefault("weight_loaders", {})[name] = ParamLoader(loader, frozenset())


def param_loaders(model: nn.Module) -> dict[str, ParamLoader]:
    """Every parameter's loader by its full name (tied parameters under each name)."""
    found = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, loader in module.__dict__.get("weight_loaders", {}).items():
            found[f"{prefix}.{name}" if prefix else name] = loader
    return found


def read_piece(source: TensorSource, piece: Slice | None) -> torch.Tensor:
    if piece is None:
        return source.read()
    return source.read_slice(piece.dim, piece.start, piece.length)


@torch.no_grad()
def copy_checked(dest: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    if dest.shape != tensor.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
    dest.copy_(tensor)


def whole_loader(piece: Slice | None = None) -> WeightLoader:
    """The tensor (or this rank's `piece` of it) fills the parameter."""

    def load(param: nn.Parameter, source: TensorSource, part: Hashable) -> None:
        copy_checked(param.data, read_piece(source, piece), source.name)

    return load


def fused_loader(sizes: dict[Hashable, int], pieces: dict[Hashable, Slice | None]) -> WeightLoader:
    """Several checkpoint tensors stacked along dim 0 of one parameter (q/k/v, gate/up), each
    `sizes[part]` rows of this rank's share, in the order `sizes` lists them."""
    offsets, start = {}, 0
    for part, size in sizes.items():
        offsets[part] = start
        start += size

    def load(param: nn.Parameter, source: TensorSource, part: Hashable) -> None:
        dest = param.data.narrow(0, offsets[part], sizes[part])
        copy_checked(dest, read_piece(source, pieces.get(part)), f"{source.name} (part {part})")

    return load


def _cut(tensor: torch.Tensor, piece: Slice | None, shift: int) -> torch.Tensor:
    """`piece` of a tensor already read, its dims moved by `shift` (1 past an expert axis)."""
    if piece is None:
        return tensor
    return tensor.narrow(piece.dim + shift, piece.start, piece.length)


def expert_loader(
    experts: range,
    sizes: dict[str, int],
    pieces: dict[str, Slice | None],
    full_sizes: dict[str, int],
) -> WeightLoader:
    """Experts stacked along dim 0 of a parameter [len(experts), rows, cols] (this rank's
    experts, global ids `experts`), each expert's projections stacked along its rows in the
    order of `sizes` (rows of each on this rank; `pieces[proj]` says which of the
    checkpoint's, None: all).

    Part (expert id, projection): one expert's 2-D tensor (Qwen3-MoE's
    `experts.{e}.gate_proj`, Mixtral's `w1`); another rank's expert is skipped unread.
    Part (None, projections): a 3-D tensor of every expert (Qwen3.5-MoE's
    `experts.gate_up_proj`), the projections stacked along its dim 1 at their checkpoint
    sizes (`full_sizes`); only this rank's experts are read."""
    offsets, start = {}, 0
    for proj, size in sizes.items():
        offsets[proj] = start
        start += size

    def load(param: nn.Parameter, source: TensorSource, part: Hashable) -> set:
        expert, projections = part
        if expert is None:
            block = source.read_slice(0, experts.start, len(experts))
            at = 0
            for proj in projections:
                tensor = _cut(block.narrow(1, at, full_sizes[proj]), pieces[proj], 1)
                at += full_sizes[proj]
                dest = param.data.narrow(1, offsets[proj], sizes[proj])
                copy_checked(dest, tensor, f"{source.name} (part {proj})")
            return {(e, proj) for e in experts for proj in projections}
        if expert not in experts:
            return set()
        proj = projections
        dest = param.data[expert - experts.start].narrow(0, offsets[proj], sizes[proj])
        copy_checked(dest, read_piece(source, pieces[proj]), f"{source.name} (expert {expert})")
        return {part}

    return load


def vocab_loader(piece: Slice | None) -> WeightLoader:
    """A vocabulary slice (embedding / LM head rows): the checkpoint fills its rows, and the
    padding past the vocabulary's end (last rank only) is zeroed, as no token reaches it."""

    def load(param: nn.Parameter, source: TensorSource, part: Hashable) -> None:
        tensor = read_piece(source, piece)
        rows = tensor.shape[0]
        with torch.no_grad():
            param.data[rows:].zero_()
        copy_checked(param.data[:rows], tensor, source.name)

    return load
