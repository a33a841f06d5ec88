"""compressed-tensors checkpoints (what LLM Compressor writes, `quant_method:
compressed-tensors`): the scheme of each layer from `config_groups` and `ignore`, and the
layouts of its formats.

Schemes served:
- weight-only int4/int8 (W4A16, W8A16), per group or per channel, symmetric or with zero
  points, act-order (`actorder: group` stores `weight_g_idx`): `pack-quantized` (codes packed
  along the input dimension in int32 words, offset by 2^(bits-1); zero points packed along the
  output dimension) or `int-quantized` / `naive-quantized` (one signed int8 per value);
- FP8 W8A8 (`float-quantized`): weights per tensor or per channel, activations dynamic per
  token or static per tensor;
- INT8 W8A8 (`int-quantized`): the same, symmetric activations.
Anything else (block or tensor-group strategies, FP4, sparsity, asymmetric activations) is
one error naming the scheme and the layers it targets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from pagefleet.engine.model.linear import LinearMethod, LinearSpec
from pagefleet.engine.model.quant.packing import pack_codes, per_word, unpack_int32
from pagefleet.engine.model.quant.scaled8 import Scaled8Method
from pagefleet.engine.model.quant.stored import Stored, read_stored, stored_reader
from pagefleet.engine.model.quant.weight_only import IntScheme, ParamDef, WeightOnlyMethod
from pagefleet.engine.model.weights import TensorSource

NAME = "compressed-tensors"
PACKED = "pack-quantized"
UNPACKED = ("int-quantized", "naive-quantized")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class CompressedIntMethod(WeightOnlyMethod):
    """Weight-only int: `packed` for pack-quantized, else one int8 per value."""

    scheme: IntScheme
    packed: bool = True

    name = NAME

    @property
    def roles(self) -> dict[str, str]:
        # The unpacked formats keep the float name for their codes.
        return {
            "codes": "weight_packed" if self.packed else "weight",
            "scales": "weight_scale",
            "zeros": "weight_zero_point",
            "g_idx": "weight_g_idx",
        }

    def params(self, spec: LinearSpec) -> dict[str, ParamDef]:
        s = self.scheme
        n, k, groups = spec.out_features, spec.in_features, self.groups(spec)
        word, mid = per_word(s.bits), 1 << (s.bits - 1)
        grouped = s.group_size is not None and not s.act_order
        gs = s.group_size or 1

        def codes(t, part):
            if self.packed:
                return pack_codes(unpack_int32(t, s.bits, dim=1)[:, :k], s.bits)
            return pack_codes((t.to(torch.int16) + mid).to(torch.uint8), s.bits)

        def zeros(t, part):
            if self.packed:
                return unpack_int32(t, s.bits, dim=0)[: spec.parts[part]]
            return (t.to(torch.int16) + mid).to(torch.uint8)

        code_layout = Stored(out_dim=0, in_dim=1, in_per=word if self.packed else 1)
        zero_layout = Stored(
            out_dim=0,
            out_per=word if self.packed else 1,
            in_dim=1 if grouped else None,
            in_per=gs,
        )
        params = {
            self.roles["codes"]: ParamDef(
                (n, k * s.bits // 8), torch.uint8, stored_reader(spec, code_layout, codes)
            ),
            "weight_scale": ParamDef((n, groups), torch.float32, _scales(spec, grouped, gs)),
            "weight_shape": ParamDef(None, None, _check_shape(spec)),
        }
        if not s.symmetric:
            params["weight_zero_point"] = ParamDef(
                (n, groups), torch.uint8, stored_reader(spec, zero_layout, zeros)
            )
        if s.act_order:
            g_idx = stored_reader(spec, Stored(in_dim=0), lambda t, part: t.to(torch.int32))
            params["weight_g_idx"] = ParamDef((k,), torch.int32, g_idx, shared=True)
        return params


def _scales(spec: LinearSpec, grouped: bool, group_size: int):
    """weight_scale `[rows, groups]` (or one per tensor, kept per row)."""
    layout = Stored(out_dim=0, in_dim=1 if grouped else None, in_per=group_size)

    def read(source: TensorSource, part: Hashable) -> torch.Tensor:
        if math.prod(source.shape) == 1:
            return source.read().float().reshape(1, 1).expand(spec.parts[part], 1).clone()
        return read_stored(source, layout, spec.part_rows(part), spec.cols).float()

    return read


def _check_shape(spec: LinearSpec):
    """weight_shape: the dense shape the codes stand for; its input width must be the
    layer's (a mismatch means codes read with the wrong packing)."""

    def read(source: TensorSource, part: Hashable) -> None:
        shape = [int(v) for v in source.read().reshape(-1).tolist()]
        if len(shape) != 2 or shape[1] != spec.full_in_features:
            raise ValueError(
                f"{source.name}: weight_shape {shape} does not match the layer's "
                f"{spec.full_in_features} input columns"
            )
        rows = spec.part_rows(part)
        if rows is None and shape[0] != spec.parts[part]:
            raise ValueError(
                f"{source.name}: weight_shape {shape} does not match the layer's "
                f"{spec.parts[part]} output rows"
            )

    return read


# ---------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class Target:
    """One config group: the layers it matches and the method they get."""

    targets: tuple[str, ...]
    method: LinearMethod | None
    describe: str
    error: str | None = None  # why the scheme cannot be served (raised when a layer uses it)


def matches(pattern: str, module: str) -> bool:
    """compressed-tensors' target rule: a regex after `re:`, the class `Linear`, or the name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == "Linear" or pattern == module


@dataclass(frozen=True)
class CompressedTensorsFormat:
    groups: tuple[Target, ...]
    ignore: tuple[str, ...]

    name = NAME

    def method_for(self, module: str) -> LinearMethod | None:
        """The method for the checkpoint's linear `module` (None: float)."""
        if any(matches(p, module) for p in self.ignore):
            return None
        for group in self.groups:
            if any(matches(p, module) for p in group.targets):
                if group.error is not None:
                    raise ValueError(f"{module}: {group.error}")
                return group.method
        return None

    def summary(self) -> str:
        return f"{NAME}: " + "; ".join(g.describe for g in self.groups)


def format_of(config: dict) -> CompressedTensorsFormat:
    """The checkpoint's compressed-tensors quantization_config, parsed."""
    if config.get("sparsity_config"):
        raise ValueError(
            "sparse compressed-tensors checkpoints (sparsity_config) are not supported"
        )
    fmt = config.get("format")
    groups = []
    for name, group in (config.get("config_groups") or {}).items():
        targets = tuple(group.get("targets") or ())
        try:
            method, describe = _method(group, group.get("format") or fmt)
            groups.append(Target(targets, method, describe))
        except ValueError as e:
            groups.append(Target(targets, None, f"{name}: unsupported", f"{name}: {e}"))
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    return CompressedTensorsFormat(tuple(groups), tuple(config.get("ignore") or ()))


def _method(group: dict, fmt: str | None) -> tuple[LinearMethod, str]:
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    if group.get("output_activations"):
        raise ValueError("output activation quantization is not supported")
    kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 0))
    strategy = weights.get("strategy")
    if kind == "float" and bits == 8:
        return _w8a8(True, weights, acts, fmt), f"FP8 W8A8 ({strategy} weights)"
    if kind == "int" and bits == 8 and acts is not None:
        return _w8a8(False, weights, acts, fmt), f"INT8 W8A8 ({strategy} weights)"
    if kind == "int" and acts is None:
        scheme = _int_scheme(weights)
        if fmt != PACKED and fmt not in UNPACKED:
            raise ValueError(f"format {fmt!r} for integer weights (pack-quantized, int-quantized)")
        return CompressedIntMethod(scheme, packed=fmt == PACKED), f"W{bits}A16 {scheme.describe()}"
    raise ValueError(
        f"weights {kind} {bits}-bit ({strategy}) with input activations "
        f"{_describe_args(acts)} (served: W4A16/W8A16 int, FP8 W8A8, INT8 W8A8)"
    )


def _int_scheme(weights: dict) -> IntScheme:
    strategy, bits = weights.get("strategy"), int(weights["num_bits"])
    if strategy not in ("group", "channel"):
        raise ValueError(f"integer weights with strategy {strategy!r} (group, channel)")
    actorder = weights.get("actorder")
    if actorder not in (None, "group", "weight", "static", "dynamic"):
        raise ValueError(f"actorder {actorder!r}")
    return IntScheme(
        bits=bits,
        group_size=int(weights["group_size"]) if strategy == "group" else None,
        symmetric=bool(weights.get("symmetric", True)),
        act_order=actorder == "group",  # "weight" reorders only while quantizing
    )


def _w8a8(fp8: bool, weights: dict, acts: dict | None, fmt: str | None) -> Scaled8Method:
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel"):
        raise ValueError(f"8-bit weights with strategy {strategy!r} (tensor, channel)")
    if not weights.get("symmetric", True):
        raise ValueError("asymmetric 8-bit weights")
    allowed = FLOAT_FORMATS if fp8 else UNPACKED
    if fmt not in allowed:
        raise ValueError(f"format {fmt!r} for 8-bit {'float' if fp8 else 'int'} weights")
    static = False
    if acts is not None:
        if not acts.get("symmetric", True):
            raise ValueError("asymmetric input activations")
        static = not acts.get("dynamic", True)
        expected = "tensor" if static else "token"
        if acts.get("strategy") != expected:
            raise ValueError(
                f"input activations {acts.get('strategy')!r} with dynamic={not static} "
                "(dynamic per token, or static per tensor)"
            )
    return Scaled8Method(fp8=fp8, static_input=static)


def _describe_args(args: dict | None) -> str:
    if not args:
        return "none"
    return f"{args.get('type')} {args.get('num_bits')}-bit {args.get('strategy')}"
