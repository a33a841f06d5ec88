"""AWQ checkpoints (AutoAWQ's GEMM layout, `quant_method: awq`): 4-bit codes and zero points
packed eight to an int32 along the output dimension, in AWQ's nibble order, and per-group
scales.

    qweight  int32 [in, out / 8]
    qzeros   int32 [groups, out / 8]
    scales   float16 [groups, out]

w = (code - zero) * scale, column k in group k // group_size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pagefleet.engine.model.linear import LinearSpec
from pagefleet.engine.model.quant.packing import AWQ_ORDER, pack_codes, unpack_int32
from pagefleet.engine.model.quant.stored import Stored, stored_reader
from pagefleet.engine.model.quant.weight_only import IntScheme, ParamDef, WeightOnlyMethod

NAME = "awq"


@dataclass(frozen=True)
class AwqMethod(WeightOnlyMethod):
    scheme: IntScheme

    name = NAME
    roles: ClassVar[dict[str, str]] = {"codes": "qweight", "scales": "scales", "zeros": "qzeros"}

    def params(self, spec: LinearSpec) -> dict[str, ParamDef]:
        s = self.scheme
        n, k, groups = spec.out_features, spec.in_features, self.groups(spec)
        gs = s.group_size or 1
        group_cols = 0 if s.group_size else None

        def codes(t, part):
            return pack_codes(unpack_int32(t, 4, dim=1, order=AWQ_ORDER).t(), 4)

        def zeros(t, part):
            return unpack_int32(t, 4, dim=1, order=AWQ_ORDER).t().contiguous()

        return {
            "qweight": ParamDef(
                (n, k // 2),
                torch.uint8,
                stored_reader(spec, Stored(out_dim=1, out_per=8, in_dim=0), codes),
            ),
            "qzeros": ParamDef(
                (n, groups),
                torch.uint8,
                stored_reader(
                    spec, Stored(out_dim=1, out_per=8, in_dim=group_cols, in_per=gs), zeros
                ),
            ),
            "scales": ParamDef(
                (n, groups),
                torch.float32,
                stored_reader(
                    spec,
                    Stored(out_dim=1, in_dim=group_cols, in_per=gs),
                    lambda t, part: t.t().float(),
                ),
            ),
        }


def method_of(config: dict) -> AwqMethod:
    """The method a checkpoint's AWQ quantization_config describes."""
    bits = int(config.get("bits", config.get("w_bit", 4)))
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4:
        raise ValueError(f"AWQ with {bits}-bit weights is not supported (4 bits)")
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (gemm)")
    if not config.get("zero_point", True):
        raise ValueError("AWQ without zero points (zero_point: false) is not supported")
    return AwqMethod(IntScheme(bits=4, group_size=None if group <= 0 else group, symmetric=False))
