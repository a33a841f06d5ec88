"""W8A8 int8 matmuls on CPU through oneDNN's prepacked int8 linear, exact on every x86 CPU.

With an int8 dot product (VNNI, AMX), oneDNN sums int8 x int8 products straight into int32,
so the activations' codes go in as they are. Without one, it adds pairs of u8 x s8 products
in int16 (vpmaddubsw), which saturates on full-range codes; `torch._int_mm` takes the same path
there, and its sums were off by millions. So on such a CPU the codes go in as two unsigned
nibbles, `code + 128 = 16 hi + lo`, whose pair sums stay far inside int16. Each nibble's sums
are exact. They are recombined in int32, and the offset's `128 * row sum` of the weight is taken
back out. Which path holds is probed once per process on the real call, not read off the CPU's
flags: an ONEDNN_MAX_CPU_ISA cap or a hypervisor can hide VNNI from oneDNN.

Either way the result is `torch._int_mm`'s exact integer sums, then the same two scalings as
quant/kernels.py's `Int8MatMul`, in its order: the same floats bit for bit whichever CPU serves
a checkpoint. A last-bit difference flips the next layer's activation codes at rounding
boundaries, and over a model's layers that moves whole tokens.
"""

from __future__ import annotations

import functools

import torch

# Compiles (or loads) the decode-size int8 kernels when a CPU W8A8 model loads, not in its first
# request: quantize_rows_int8 and scale_sums take them (quant/int8_numba.py).
from pagefleet.engine.model.quant import int8_numba  # noqa: F401
from pagefleet.engine.model.quant.kernels import quantize_rows_int8, scale_sums

# 15 * 127 * 8192 < 2**24: a nibble's sums over this many columns stay exact in float32,
# the dtype oneDNN returns them in.
NIBBLE_COLUMNS = 8192


def onednn_int8_available() -> bool:
    return hasattr(torch.ops.onednn, "qlinear_prepack") and torch.backends.mkldnn.is_available()


@functools.cache
def signed_codes_are_exact() -> bool:
    """Whether oneDNN's int8 linear sums signed int8 codes exactly on this CPU (probed once):
    a full-range row against a full-range weight row, where int16 pair sums saturate."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (4, 1024), generator=gen, dtype=torch.int8)
    w = torch.randint(-127, 128, (32, 1024), generator=gen, dtype=torch.int8)
    x[0], w[0] = 127, 127
    got = _sums(torch.ops.onednn.qlinear_prepack(w, None), x, _Unit(32))
    return torch.equal(got.to(torch.int64), x.long() @ w.long().t())


def _sums(packed: torch.Tensor, codes: torch.Tensor, unit: _Unit) -> torch.Tensor:
    """codes @ weight^T as float32, no scale applied (codes int8 or uint8, zero point 0)."""
    return torch.ops.onednn.qlinear_pointwise.tensor(
        codes, unit.one, unit.zero, packed, unit.ones, unit.zeros,
        None, 1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip


class _Unit:
    """oneDNN's scales and zero points for unscaled sums into `out` columns (made once)."""

    def __init__(self, out: int) -> None:
        self.one, self.zero = torch.tensor(1.0), torch.tensor(0, dtype=torch.int64)
        self.ones, self.zeros = torch.ones(out), torch.zeros(out, dtype=torch.int64)


class OneDnnInt8MatMul:
    """INT8 W8A8 on a CPU: the weight reordered once into oneDNN's blocked layout (per column
    slice for the nibble path), activations quantized as `Int8MatMul` does, exact integer sums
    (see the module docstring), then `Int8MatMul`'s scalings. 1.2-2x `Int8MatMul` at decode
    sizes on a VNNI CPU (benchmarks/quantization.py --kernels)."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        input_scale: float | None,
        signed: bool | None = None,
    ):
        self.out_features = weight.shape[0]
        self.signed = signed_codes_are_exact() if signed is None else signed
        weight = weight.contiguous()
        parts = [weight] if self.signed else weight.split(NIBBLE_COLUMNS, dim=1)
        self.packed = [torch.ops.onednn.qlinear_prepack(p.contiguous(), None) for p in parts]
        # The nibbles' +128 per code, taken back out of their sums.
        self.offset = None if self.signed else 128 * weight.sum(dim=1, dtype=torch.int32)
        self.scale = scale.float()
        self.input_scale = input_scale
        self.unit = _Unit(self.out_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        codes, a = quantize_rows_int8(x.reshape(-1, shape[-1]), self.input_scale)
        acc = _sums(self.packed[0], codes, self.unit) if self.signed else self._nibble_sums(codes)
        return scale_sums(acc, a, self.scale, bias, dtype).reshape(*shape[:-1], self.out_features)

    def _nibble_sums(self, codes: torch.Tensor) -> torch.Tensor:
        """The exact int32 sums from unsigned nibbles (no int16 pair sum can saturate)."""
        unsigned = codes.view(torch.uint8).bitwise_xor(128)  # code + 128, as two's complement
        acc = -self.offset.expand(codes.shape[0], -1)
        for packed, part in zip(self.packed, unsigned.split(NIBBLE_COLUMNS, dim=1), strict=True):
            high = _sums(packed, (part >> 4).contiguous(), self.unit).to(torch.int32)
            low = _sums(packed, (part & 15).contiguous(), self.unit).to(torch.int32)
            acc = acc + high * 16 + low
        return acc

    def tensors(self) -> list[torch.Tensor]:
        offset = [] if self.offset is None else [self.offset]
        return [*self.packed, self.scale, *offset]
