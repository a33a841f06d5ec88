"""Work run by tests/test_quant_kernels.py in a process with TRITON_INTERPRET=1 (set by
triton_interpret_cases.enable_interpreter before any kernel module is imported): the Triton
W4A16/W8A16 kernel on CPU tensors. Cases return tensors; the assertions stay in the test."""

from __future__ import annotations

import torch

from pagefleet.engine.model.quant.int_weight import IntWeight
from pagefleet.engine.model.quant.packing import pack_codes


def random_int_weight(
    out: int, cols: int, bits: int, group: int | None, act_order: bool, seed: int
) -> IntWeight:
    """Random codes, scales and asymmetric zero points (act-order: a random group per
    column, some groups left uneven as a tensor-parallel shard's are)."""
    gen = torch.Generator().manual_seed(seed)
    gs = group or cols
    groups = cols // gs
    codes = torch.randint(0, 1 << bits, (out, cols), generator=gen, dtype=torch.uint8)
    scales = torch.rand(out, groups, generator=gen) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, (out, groups), generator=gen).float()
    g_idx = None
    if act_order:
        g_idx = torch.randint(0, groups, (cols,), generator=gen, dtype=torch.int32)
    return IntWeight(pack_codes(codes, bits), bits, scales, -zeros * scales, gs, cols, g_idx)


def triton_int_case(
    out: int, cols: int, bits: int, group: int | None, act_order: bool, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the Triton kernel's x W^T, x times the dequantized W^T) in float32."""
    from pagefleet.engine.model.quant.kernels import TritonIntKernel

    weight = random_int_weight(out, cols, bits, group, act_order, seed=out + cols + bits)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    return TritonIntKernel(weight)(x), x @ weight.dequantize().t()
