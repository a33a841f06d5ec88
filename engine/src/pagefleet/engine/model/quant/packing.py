"""Bit packing of integer weight codes: the checkpoints' int32 words (GPTQ, AWQ,
compressed-tensors) and the engine's canonical layout.

Canonical codes are unsigned (0 .. 2^bits - 1), one row per output feature: `[out, in]` bytes
for 8 bits, `[out, in / 2]` for 4 bits with input column 2j in the low nibble of byte j.
Checkpoints pack 32 / bits codes into an int32 word along one dimension, value i at bits
i*bits.. (AWQ stores its eight nibbles in the order AWQ_ORDER instead).
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (4, 8)
# AWQ's GEMM layout: nibble i of a word holds column AWQ_ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def check_bits(bits: int, what: str) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{what}: {bits}-bit weights are not supported (4 or 8 bits)")


def per_word(bits: int) -> int:
    return 32 // bits


def unpack_int32(
    words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """int32 words holding 32/bits codes each along `dim` -> the codes (uint8), that dim
    32/bits times longer. `order[i]`: the position within its word of the code in bits i."""
    n = per_word(bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    w = words.to(torch.int32).movedim(dim, -1).unsqueeze(-1)
    codes = torch.bitwise_and(torch.bitwise_right_shift(w, shifts), (1 << bits) - 1)
    if order is not None:
        codes = codes[..., torch.tensor(_inverse(order), device=words.device)]
    codes = codes.reshape(*w.shape[:-2], w.shape[-2] * n).to(torch.uint8)
    return codes.movedim(-1, dim).contiguous()


def pack_int32(
    codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """The inverse of `unpack_int32` (the reference quantizer writes checkpoints with it)."""
    n = per_word(bits)
    c = codes.to(torch.int64).movedim(dim, -1)
    if c.shape[-1] % n:
        raise ValueError(f"{c.shape[-1]} codes do not fill whole int32 words of {n}")
    c = c.reshape(*c.shape[:-1], c.shape[-1] // n, n)
    if order is not None:
        c = c[..., torch.tensor(order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (c << shifts).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _inverse(order: tuple[int, ...]) -> list[int]:
    inverse = [0] * len(order)
    for slot, position in enumerate(order):
        inverse[position] = slot
    return inverse


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes `[out, in]` -> the canonical layout (4 bits: two per byte along `in`)."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit codes need an even number of input columns, not {codes.shape[-1]}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The canonical layout -> codes `[out, in]` (uint8)."""
    if bits == 8:
        return packed
    both = torch.stack([packed & 15, packed >> 4], dim=-1)
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
