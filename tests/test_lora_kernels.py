"""The LoRA Triton kernels (engine/lora/triton_ops.py) in Triton's interpreter on CPU tensors,
over the layers' own weight layouts, against the gathered torch reference and a per-row one:
base rows, several slots, widths and inputs that are no multiple of the tiles, bfloat16. (A
whole engine on interpreted kernels takes minutes: the layers' wiring is the CPU kernels'.)"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import triton_interpret_cases
import triton_lora_cases as cases


@pytest.fixture(scope="module")
def interpreter():
    context = multiprocessing.get_context("spawn")
    initializer = triton_interpret_cases.enable_interpreter
    with ProcessPoolExecutor(1, mp_context=context, initializer=initializer) as pool:
        yield lambda fn, *args: pool.submit(fn, *args).result(timeout=300)


DELTAS = {
    # (slots, width, in, out, row slots, dtype)
    "decode-rows": (4, 12, 64, 96, [2, -1, 0, 2, 3, -1], torch.float32),
    "ragged-tiles": (3, 5, 70, 33, [1, 1, 1, 0, -1, 2, 2], torch.float32),
    "one-slot-bf16": (2, 24, 128, 64, [1] * 5, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(DELTAS))
def test_triton_delta_equals_the_gathered_reference(interpreter, name):
    ours, gathered, per_row = interpreter(cases.delta_case, *DELTAS[name])
    if DELTAS[name][-1] == torch.float32:
        # Sums over tiles in another order than torch's.
        torch.testing.assert_close(ours, gathered, rtol=1e-4, atol=1e-4)
    # bfloat16: float32 sums, the shrink stored in bfloat16, one rounding of the result.
    torch.testing.assert_close(ours, per_row, rtol=1e-2, atol=1e-2)
