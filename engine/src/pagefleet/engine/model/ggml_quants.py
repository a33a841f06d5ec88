"""ggml's tensor encodings: the block layouts of llama.cpp's ggml-quants.c for the types
pagefleet loads, in vectorised torch over a tensor's raw bytes.

Each decoder takes the raw bytes as uint8 `[n_blocks, bytes per block]` and returns float32
`[n_blocks, values per block]`; `dequantize` applies one to a whole tensor. Scales are stored as
float16 and the products are formed in float32, as the reference does (tests check every type
against the `gguf` library's reference dequantization). `block_codes` reads the same blocks as
integer codes with a scale and an offset per sub-block (value = code * scale + offset), which
the quantized linear method keeps as they are (model/quant/gguf.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # values per super-block of the k-quants
K_SCALES = 12  # bytes of packed 6-bit scales and mins in Q4_K / Q5_K


def _f16(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes start..start+2 of every block, as float32 `[n_blocks, 1]`."""
    return raw[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, group: int) -> torch.Tensor:
    """Byte groups of `group` bytes unpacked to 2*group values: low nibbles, then high."""
    n = packed.shape[0]
    grouped = packed.reshape(n, -1, group)
    both = torch.empty(n, grouped.shape[1], 2, group, dtype=torch.uint8)
    torch.bitwise_and(grouped, 0x0F, out=both[:, :, 0])
    torch.bitwise_right_shift(grouped, 4, out=both[:, :, 1])
    return both.reshape(n, -1)


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    return raw[:, 2:].contiguous().view(torch.int8).float() * _f16(raw, 0)


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    return _nibbles(raw[:, 2:], 16).float().sub_(8.0).mul_(_f16(raw, 0))


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    return _nibbles(raw[:, 4:], 16).float().mul_(_f16(raw, 0)).add_(_f16(raw, 2))


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins packed in 12 bytes (Q4_K, Q5_K): bytes 0-3 hold
    scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; scales and mins 4-7 take their low 4 bits from
    the nibbles of bytes 8-11 and their top 2 bits from the spare bits of bytes 0-3 / 4-7."""
    low_sc, low_m, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low_sc & 0x3F, (high & 0x0F) | ((low_sc >> 6) << 4)], dim=1)
    mins = torch.cat([low_m & 0x3F, (high >> 4) | ((low_m >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _k_affine(raw: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """value = d * scale_j * q - dmin * min_j over 8 sub-blocks of 32 (Q4_K, Q5_K)."""
    n = raw.shape[0]
    scales, mins = _k_scales(raw[:, 4 : 4 + K_SCALES])
    step = (_f16(raw, 0) * scales).unsqueeze(-1)
    offset = (_f16(raw, 2) * mins).unsqueeze(-1)
    return (step * q.reshape(n, 8, 32).float() - offset).reshape(n, QK_K)


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    return _k_affine(raw, _nibbles(raw[:, 4 + K_SCALES :], 32))


def _q5_k_codes(raw: torch.Tensor) -> torch.Tensor:
    """Q5_K's 5-bit values `[n, 256]`: a low nibble and a fifth bit each."""
    n = raw.shape[0]
    high_bits = raw[:, 4 + K_SCALES : 4 + K_SCALES + 32]  # bit j of byte l: sub-block j, value l
    low = _nibbles(raw[:, 4 + K_SCALES + 32 :], 32).reshape(n, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    fifth = (high_bits.unsqueeze(1) >> shifts) & 1
    return (low | (fifth << 4)).reshape(n, QK_K)


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    return _k_affine(raw, _q5_k_codes(raw))


def _q6_k_codes(raw: torch.Tensor) -> torch.Tensor:
    """Q6_K's 6-bit values `[n, 256]` (0..63). Two halves of 128 values; each half has 64 bytes
    of low nibbles (values l and l+64 share byte l, l+32 and l+96 byte l+32) and 32 bytes of
    2-bit high parts (4 values per byte)."""
    n = raw.shape[0]
    low_bytes = raw[:, :128].reshape(n, 2, 2, 32)  # [half, which 32 bytes, l]
    high_bytes = raw[:, 128:192].reshape(n, 2, 1, 32)
    low = torch.stack([low_bytes & 0x0F, low_bytes >> 4], dim=2)  # [half, nibble, part, l]
    low = low.reshape(n, 2, 4, 32)  # quarter q = 2*nibble + part: values 32q..32q+31
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (high_bytes >> shifts) & 0x03
    return (low | (high << 4)).reshape(n, QK_K)


def _q6_k_steps(raw: torch.Tensor) -> torch.Tensor:
    """d x each sub-block's int8 scale, `[n, 16]` (one per 16 values)."""
    return _f16(raw, 208) * raw[:, 192:208].contiguous().view(torch.int8).float()


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    n = raw.shape[0]
    q = _q6_k_codes(raw).float() - 32.0
    return (_q6_k_steps(raw).reshape(n, 16, 1) * q.reshape(n, 16, 16)).reshape(n, QK_K)


_FLOATS = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_BLOCK_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
SUPPORTED_TYPES = frozenset(_FLOATS) | frozenset(_BLOCK_DECODERS)


def dequantize(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """A tensor's raw bytes (uint8, 1-D) as float32 values, flat, in the file's order."""
    if ggml_type in _FLOATS:
        return raw.view(_FLOATS[ggml_type]).float()
    decode = _BLOCK_DECODERS.get(ggml_type)
    if decode is None:
        raise ValueError(f"ggml type {ggml_type.name} is not supported")
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    return decode(raw.reshape(-1, block_bytes)).reshape(-1)


@dataclass
class BlockCodes:
    """Blocks as codes: value = codes * scale + offset, one (scale, offset) per `group`
    values. codes `[n_blocks, values]` uint8 (0 .. 2^bits - 1), scales and offsets float32
    `[n_blocks, values / group]`."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int  # significant bits of a code: 4 fit a nibble, more take a byte
    group: int


def _q8_0_codes(raw: torch.Tensor) -> BlockCodes:
    d = _f16(raw, 0)
    codes = (raw[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return BlockCodes(codes, d, -128 * d, 8, 32)


def _q4_0_codes(raw: torch.Tensor) -> BlockCodes:
    d = _f16(raw, 0)
    return BlockCodes(_nibbles(raw[:, 2:], 16), d, -8 * d, 4, 32)


def _q4_1_codes(raw: torch.Tensor) -> BlockCodes:
    return BlockCodes(_nibbles(raw[:, 4:], 16), _f16(raw, 0), _f16(raw, 2), 4, 32)


def _k_codes(raw: torch.Tensor, codes: torch.Tensor, bits: int) -> BlockCodes:
    scales, mins = _k_scales(raw[:, 4 : 4 + K_SCALES])
    return BlockCodes(codes, _f16(raw, 0) * scales, -(_f16(raw, 2) * mins), bits, 32)


def _q6_k_block_codes(raw: torch.Tensor) -> BlockCodes:
    steps = _q6_k_steps(raw)
    return BlockCodes(_q6_k_codes(raw), steps, -32 * steps, 6, 16)


_CODE_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], BlockCodes]] = {
    GGMLQuantizationType.Q8_0: _q8_0_codes,
    GGMLQuantizationType.Q4_0: _q4_0_codes,
    GGMLQuantizationType.Q4_1: _q4_1_codes,
    GGMLQuantizationType.Q4_K: lambda raw: _k_codes(raw, _nibbles(raw[:, 4 + K_SCALES :], 32), 4),
    GGMLQuantizationType.Q5_K: lambda raw: _k_codes(raw, _q5_k_codes(raw), 5),
    GGMLQuantizationType.Q6_K: _q6_k_block_codes,
}
CODED_TYPES = frozenset(_CODE_DECODERS)


def block_geometry(ggml_type: GGMLQuantizationType) -> tuple[int, int]:
    """(values, bytes) of one block of a coded type."""
    return GGML_QUANT_SIZES[ggml_type]


def block_codes(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> BlockCodes:
    """Raw blocks `[n_blocks, bytes per block]` of a coded type as codes, scales, offsets."""
    return _CODE_DECODERS[ggml_type](raw)
