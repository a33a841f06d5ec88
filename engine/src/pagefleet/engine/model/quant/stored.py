"""How a quantized checkpoint tensor is laid out on disk, so that a tensor-parallel rank reads
only its slice of it: which stored dimension runs along the layer's output rows and which
along its input columns, and how many rows or columns one stored element covers (8 codes in
an int32 word, a group of columns per scale).

A rank's slice of a layer is given in the layer's own rows and columns (`LinearSpec.rows`,
`.cols`); `read_stored` turns it into the stored tensor's slice, and refuses a slice that
would split a packed word or a scale group, naming the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from pagefleet.engine.model.linear import LinearSpec, PartReader
from pagefleet.engine.model.weights import Slice, TensorSource


@dataclass(frozen=True)
class Stored:
    """A stored tensor's axes: `out_dim` runs along output rows (`out_per` rows per stored
    element), `in_dim` along input columns (`in_per` columns per element); None where the
    tensor does not (a per-tensor scale has neither, g_idx no output axis)."""

    out_dim: int | None = None
    out_per: int = 1
    in_dim: int | None = None
    in_per: int = 1


def _stored_slice(piece: Slice, dim: int, per: int, source: TensorSource, axis: str) -> Slice:
    if piece.start % per or piece.length % per:
        raise ValueError(
            f"{source.name}: this rank's {axis} {piece.start}..{piece.start + piece.length} do "
            f"not fall on whole stored elements of {per}; choose a --tensor-parallel-size "
            "that splits the layer at a multiple of its packing and group size"
        )
    return Slice(dim, piece.start // per, piece.length // per)


def read_stored(source: TensorSource, layout: Stored, rows: Slice | None, cols: Slice | None):
    """This rank's slice of a stored tensor (rows: the layer's output rows it holds, cols: its
    input columns), read without the rest."""
    pieces = []
    if rows is not None and layout.out_dim is not None:
        pieces.append(_stored_slice(rows, layout.out_dim, layout.out_per, source, "output rows"))
    if cols is not None and layout.in_dim is not None:
        pieces.append(_stored_slice(cols, layout.in_dim, layout.in_per, source, "input columns"))
    if not pieces:
        return source.read()
    first, *rest = pieces
    tensor = source.read_slice(first.dim, first.start, first.length)
    for piece in rest:
        tensor = tensor.narrow(piece.dim, piece.start, piece.length)
    return tensor


Convert = Callable[[torch.Tensor, Hashable], torch.Tensor]


def stored_reader(spec: LinearSpec, layout: Stored, convert: Convert) -> PartReader:
    """A `PartReader` (model/linear.py): the part's slice as stored, then `convert(tensor,
    part)` into the parameter's row-major form."""

    def read(source: TensorSource, part: Hashable) -> torch.Tensor:
        return convert(read_stored(source, layout, spec.part_rows(part), spec.cols), part)

    return read
