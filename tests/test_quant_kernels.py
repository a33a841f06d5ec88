"""The quantized-weight kernels against their dequantized weights: bit packing against the
formats' documented layouts, torch's packed CPU kernels (with bfloat16 activations, see
quant/cpu_kernels.py), the Triton W4A16/W8A16 kernel in Triton's interpreter, and the GPU's
FP8 GEMM call on CPU tensors (torch's _scaled_mm runs there too), plus its refusal below
compute capability 8.9."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import triton_interpret_cases
import triton_quant_cases as cases
from torch.testing import assert_close

from pagefleet.engine.model.quant import kernels
from pagefleet.engine.model.quant.cpu_kernels import CpuIntKernel
from pagefleet.engine.model.quant.packing import (
    AWQ_ORDER,
    pack_codes,
    pack_int32,
    unpack_codes,
    unpack_int32,
)


def test_int32_words_hold_codes_from_the_low_bits_up():
    """GPTQ / compressed-tensors: code i at bits 4i; AWQ: its nibble order 0,2,4,6,1,3,5,7."""
    codes = torch.arange(8, dtype=torch.uint8).reshape(1, 8)
    assert pack_int32(codes, 4, dim=1).item() == 0x76543210
    assert pack_int32(codes, 4, dim=1, order=AWQ_ORDER).item() == 0x75316420
    assert pack_int32(torch.tensor([[1, 2, 3, 255]]), 8, dim=1).item() == -0x00FCFDFF
    gen = torch.Generator().manual_seed(0)
    for bits, dim, order in [(4, 0, None), (4, 1, AWQ_ORDER), (8, 0, None), (8, 1, None)]:
        codes = torch.randint(0, 1 << bits, (16, 24), generator=gen, dtype=torch.uint8)
        words = pack_int32(codes, bits, dim, order)
        assert torch.equal(unpack_int32(words, bits, dim, order), codes)
        assert torch.equal(unpack_codes(pack_codes(codes, bits), bits), codes)


CPU_CASES = {
    "int4-g32": (48, 96, 4, 32, False),  # 48 rows: tinygemm pads to 64
    "int4-g128": (64, 256, 4, 128, False),
    "int4-channel": (32, 96, 4, None, False),  # one group of 96 runs as three of 32
    "int4-act-order-uneven": (40, 128, 4, 32, True),
    "int8-channel": (40, 64, 8, None, False),  # int8pack + the zero point's correction
    "int8-g32": (32, 128, 8, 32, False),  # two 4-bit planes
    "int8-act-order": (24, 96, 8, 32, True),
}


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_kernels_multiply_by_the_dequantized_weight(name):
    out, cols, bits, group, act_order = CPU_CASES[name]
    weight = cases.random_int_weight(out, cols, bits, group, act_order, seed=7)
    x = torch.randn(2, 3, cols, generator=torch.Generator().manual_seed(1))
    want = x @ weight.dequantize().t()
    got = CpuIntKernel(weight)(x)
    assert got.shape == want.shape
    # bfloat16 activations and scales: ~2^-8 of the output's scale
    assert_close(got, want, atol=1e-2 * want.abs().max().item(), rtol=0)


def _int8_w8a8_kernels() -> list[type]:
    """The CPU's W8A8 kernels: torch._int_mm everywhere, oneDNN's where int8 dots exist."""
    found: list[type] = [kernels.Int8MatMul]
    if kernels._cpu_has_int8_dot():
        found.append(kernels.OneDnnInt8MatMul)
    return found


@pytest.mark.parametrize("kernel", _int8_w8a8_kernels(), ids=lambda k: k.__name__)
@pytest.mark.parametrize("input_scale", [None, 0.05], ids=["dynamic", "static"])
def test_int8_w8a8_kernels_sum_integer_products_exactly(kernel, input_scale):
    """Each row's int8 codes times the weight's codes, summed exactly, then both scales and
    the bias. Row 0 is all +127 against a weight row of +127: pairs of those products
    overflow int16, so a kernel that sums pairs in int16 (oneDNN's path without VNNI) fails."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randint(-127, 128, (40, 256), generator=gen, dtype=torch.int8)
    weight[0] = 127
    scale = torch.rand(40, generator=gen) + 0.5
    bias = torch.randn(40, generator=gen)
    x = torch.randn(2, 3, 256, generator=gen) * torch.arange(1, 7).reshape(2, 3, 1)
    x[0, 0] = 6.0 if input_scale is None else 127 * input_scale
    codes, a = kernels.quantize_rows_int8(x.reshape(6, 256), input_scale)
    assert codes.abs().max() <= 127 and torch.all(codes[0] == 127)
    exact = (codes.long() @ weight.long().t()).double()
    a = torch.as_tensor(a, dtype=torch.float64)
    want = (exact * a * scale.double() + bias.double()).reshape(2, 3, 40)
    got = kernel(weight, scale, input_scale)(x, bias)
    assert got.dtype == x.dtype
    assert_close(got.double(), want, rtol=1e-5, atol=1e-3)
    bf16 = kernel(weight, scale, input_scale)(x.bfloat16(), None)
    assert bf16.dtype == torch.bfloat16
    # Every int8 kernel gives torch._int_mm's floats exactly: a checkpoint's tokens must not
    # depend on which CPU serves it (a last bit flips the next layer's activation codes).
    reference = kernels.Int8MatMul(weight, scale, input_scale)
    assert torch.equal(got, reference(x, bias))
    assert torch.equal(bf16, reference(x.bfloat16(), None))


@pytest.fixture(scope="module")
def interpreter():
    """A worker whose Triton kernels run in the interpreter on CPU tensors."""
    context = multiprocessing.get_context("spawn")
    init = triton_interpret_cases.enable_interpreter
    with ProcessPoolExecutor(1, mp_context=context, initializer=init) as pool:
        yield lambda fn, *args: pool.submit(fn, *args).result(timeout=300)


TRITON_CASES = {
    "w4-g32-decode": (40, 96, 4, 32, False, 1),  # rows and columns past the tiles' edges
    "w4-channel-prefill": (70, 128, 4, None, False, 20),
    "w8-g16": (64, 80, 8, 16, False, 3),  # a group smaller than a tile
    "w4-act-order": (32, 128, 4, 32, True, 5),
    "w8-act-order": (48, 64, 8, 16, True, 2),
}


@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_int_kernel_in_the_interpreter(interpreter, name):
    got, want = interpreter(cases.triton_int_case, *TRITON_CASES[name])
    assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_gpu_fp8_gemm_scales_rows_and_tokens():
    """Fp8MatMul is what a GPU of capability >= 8.9 runs; torch's _scaled_mm runs it on CPU
    tensors too: each token's e4m3 activations times the e4m3 weight, both rescaled."""
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(32, 64, generator=gen) * 40).to(kernels.FP8_DTYPE)
    scale = torch.rand(32, generator=gen) + 0.5
    x = torch.randn(5, 64, generator=gen) * torch.arange(1, 6).reshape(5, 1)
    bias = torch.randn(32, generator=gen)
    w = weight.float() * scale[:, None]
    a = x.abs().amax(1, keepdim=True) / kernels.FP8_MAX
    xq = (x / a).to(kernels.FP8_DTYPE).float() * a
    assert_close(
        kernels.Fp8MatMul(weight, scale, None)(x, bias), xq @ w.t() + bias, rtol=2e-2, atol=0.1
    )
    static = (x / 0.01).clamp(-448, 448).to(kernels.FP8_DTYPE).float() * 0.01
    assert_close(
        kernels.Fp8MatMul(weight, scale, 0.01)(x, None), static @ w.t(), rtol=2e-2, atol=0.1
    )


def test_fp8_below_compute_capability_8_9_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or newer.*A100 is 8\.0"):
        kernels.check_fp8_capability(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    kernels.check_fp8_capability(torch.device("cuda"))
