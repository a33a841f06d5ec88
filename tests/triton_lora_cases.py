"""Work run by tests/test_lora_kernels.py in a process with TRITON_INTERPRET=1 (see
triton_interpret_cases.py for why): the LoRA Triton kernels against torch references."""

from __future__ import annotations

import functools

import torch


def round_bfloat16_as_gpus_do() -> None:
    """Triton's interpreter (3.9) casts float32 to bfloat16 by cutting the mantissa (its
    cast passes no rounding mode); a GPU rounds to nearest even. The cast goes through torch
    here, so the test sees the kernel, not the interpreter (as triton_interpret_cases does
    for float8)."""
    from triton.runtime import interpreter

    if getattr(interpreter._convert_float, "rounds_bfloat16", False):
        return
    converter = functools.partial(_convert_bfloat16, interpreter._convert_float)
    converter.rounds_bfloat16 = True
    interpreter._convert_float = converter


def _convert_bfloat16(convert, data, input_dtype, output_dtype, rounding_mode):
    import numpy as np
    import triton.language as tl

    if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
        values = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
        return values.to(torch.bfloat16).view(torch.uint16).numpy()
    return convert(data, input_dtype, output_dtype, rounding_mode)


def delta_case(slots: int, width: int, n_in: int, n_out: int, row_slots: list[int], dtype):
    """(Triton's y, the gathered reference's y, a per-row float32 reference with the shrink
    rounded to `dtype` between the halves, as the kernels store it) for one shrink + expand
    over random slot weights."""
    from pagefleet.engine.lora.ops import GatheredKernels, LoRABatch
    from pagefleet.engine.lora.triton_ops import TritonKernels

    round_bfloat16_as_gpus_do()
    gen = torch.Generator().manual_seed(len(row_slots) + n_in)
    a = torch.randn(slots * width, n_in, generator=gen).to(dtype)
    b = torch.randn(n_out, slots * width, generator=gen).to(dtype)
    x = torch.randn(len(row_slots), n_in, generator=gen).to(dtype)
    y = torch.randn(len(row_slots), n_out, generator=gen).to(dtype)
    batch = LoRABatch.build(row_slots, x.device)
    present = [True] * slots
    results = []
    for kernels in (TritonKernels, GatheredKernels):
        out = y.clone()
        t = kernels.shrink(x, a, batch, width, present)
        kernels.expand(t, b, batch, width, present, out)
        results.append(out.float())
    rows = y.float().clone()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            s = slice(slot * width, (slot + 1) * width)
            t = (a[s].float() @ x[row].float()).to(dtype).float()
            rows[row] += b[:, s].float() @ t
    results.append(rows.to(dtype).float())
    return results
