"""GPTQ checkpoints (AutoGPTQ / GPTQModel's layout, `quant_method: gptq`): 4- or 8-bit codes
packed along the input dimension, per-group scales and zero points packed along the output
dimension, and `g_idx` (the group of every input column: act-order, `desc_act`).

    qweight  int32 [in / (32/bits), out]
    qzeros   int32 [groups, out / (32/bits)]   zero point - 1 (v1), or as is (gptq_v2)
    scales   float16 [groups, out]
    g_idx    int32 [in]

w = (code - zero) * scale, the group of column k being g_idx[k] (k // group_size without
act-order, where g_idx is stored but carries nothing more).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pagefleet.engine.model.linear import LinearSpec
from pagefleet.engine.model.quant.packing import pack_codes, per_word, unpack_int32
from pagefleet.engine.model.quant.stored import Stored, stored_reader
from pagefleet.engine.model.quant.weight_only import IntScheme, ParamDef, WeightOnlyMethod

NAME = "gptq"


@dataclass(frozen=True)
class GptqMethod(WeightOnlyMethod):
    scheme: IntScheme
    zero_offset: int = 1  # v1 stores zero - 1

    name = NAME
    roles: ClassVar[dict[str, str]] = {
        "codes": "qweight",
        "scales": "scales",
        "zeros": "qzeros",
        "g_idx": "g_idx",
    }

    def params(self, spec: LinearSpec) -> dict[str, ParamDef]:
        s = self.scheme
        n, k, groups = spec.out_features, spec.in_features, self.groups(spec)
        word = per_word(s.bits)
        # Act-order ranks read every group; one group per row is not split either.
        group_cols = None if s.act_order or s.group_size is None else 0
        per_group = s.group_size or 1

        def codes(t, part):
            return pack_codes(unpack_int32(t, s.bits, dim=0).t(), s.bits)

        def zeros(t, part):  # v1's zero - 1 wraps as the packers' own conversion does
            stored = unpack_int32(t, s.bits, dim=1).t().to(torch.int16)
            return ((stored + self.zero_offset) & ((1 << s.bits) - 1)).to(torch.uint8)

        def scales(t, part):
            return t.t().float()

        params = {
            "qweight": ParamDef(
                (n, k * s.bits // 8),
                torch.uint8,
                stored_reader(spec, Stored(out_dim=1, in_dim=0, in_per=word), codes),
            ),
            "scales": ParamDef(
                (n, groups),
                torch.float32,
                stored_reader(spec, Stored(out_dim=1, in_dim=group_cols, in_per=per_group), scales),
            ),
            "qzeros": ParamDef(
                (n, groups) if not s.symmetric else None,
                torch.uint8,
                stored_reader(
                    spec,
                    Stored(out_dim=1, out_per=word, in_dim=group_cols, in_per=per_group),
                    zeros,
                ),
            ),
        }
        g_idx = stored_reader(spec, Stored(in_dim=0), lambda t, part: t.to(torch.int32))
        params["g_idx"] = ParamDef((k,), torch.int32, g_idx, shared=True)
        if not s.act_order:
            params["g_idx"] = ParamDef(None, None, g_idx)  # implied by group_size
        if not spec.bias:
            params["bias"] = ParamDef(None, None, _zero_bias)
        return params


def _zero_bias(source, part) -> None:
    """AutoGPTQ saves a bias for every linear, zeros where the model has none: accept those."""
    if bool(source.read().any()):
        raise ValueError(f"{source.name}: a non-zero bias on a layer the model has none for")


def method_of(config: dict) -> GptqMethod:
    """The method a checkpoint's GPTQ quantization_config describes."""
    bits = int(config.get("bits", 4))
    group = int(config.get("group_size", 128))
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    scheme = IntScheme(
        bits=bits,
        group_size=None if group <= 0 else group,
        symmetric=False,  # GPTQ stores zero points even when symmetric
        act_order=bool(config.get("desc_act", False)),
    )
    return GptqMethod(scheme, zero_offset=1 if fmt == "gptq" else 0)
