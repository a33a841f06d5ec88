"""The quantized-weight kernels against their dequantized weights: bit packing against the
formats' documented layouts, torch's packed CPU kernels (with bfloat16 activations, see
quant/cpu_kernels.py), the Triton W4A16/W8A16 kernel in Triton's interpreter, and the GPU's
FP8 GEMM call on CPU tensors (torch's _scaled_mm runs there too), plus its refusal below
compute capability 8.9."""

from __future__ import annotations

import functools
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import triton_interpret_cases
import triton_quant_cases as cases
from torch.testing import assert_close

from pagefleet.engine.model.quant import int4_tiles, kernels
from pagefleet.engine.model.quant.cpu_int8 import (
    NIBBLE_COLUMNS,
    OneDnnInt8MatMul,
    signed_codes_are_exact,
)
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


TILE_CASES = {
    "int4-g32": (128, 96, 4, 32, False),
    "int4-g64-two-blocks-of-rows": (192, 128, 4, 64, False),
    "int4-act-order": (64, 128, 4, 32, True),
    "int8-g32-two-planes": (64, 64, 8, 32, False),
}


@pytest.mark.parametrize("name", list(TILE_CASES))
def test_prompt_rows_on_tiles_multiply_by_the_dequantized_weight(name, monkeypatch):
    """From PROMPT_ROWS rows the tiles (quant/int4_tiles.py) read tinygemm's own packed
    bytes: several tiles per weight here, the same product as tinygemm's to bfloat16
    rounding, and the dequantized weight's to the kernels' precision."""
    monkeypatch.setattr(int4_tiles, "TILE_BYTES", 2 * 128 * 64)  # 64-row tiles: several
    out, cols, bits, group, act_order = TILE_CASES[name]
    weight = cases.random_int_weight(out, cols, bits, group, act_order, seed=3)
    rows = int4_tiles.PROMPT_ROWS + 3
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(4))
    tiled = CpuIntKernel(weight, prompt_path="tiles")
    assert all(plane.use_tiles for plane in tiled.planes)
    calls = []
    original = int4_tiles.Int4Tiles.__call__
    monkeypatch.setattr(
        int4_tiles.Int4Tiles, "__call__", lambda self, x: calls.append(1) or original(self, x)
    )
    got = tiled(x)
    assert len(calls) == len(tiled.planes)
    want = x @ weight.dequantize().t()
    assert_close(got, want, atol=1e-2 * want.abs().max().item(), rtol=0)
    on_tinygemm = CpuIntKernel(weight, prompt_path="tinygemm")(x)
    # both round their sums to bfloat16: two of its steps at the output's scale
    assert_close(got, on_tinygemm, atol=2**-7 * want.abs().max().item(), rtol=0)
    calls.clear()
    tiled(x[: int4_tiles.PROMPT_ROWS - 1])  # fewer rows: tinygemm, which reads codes once
    assert not calls


def test_tiles_decline_bytes_not_in_tinygemms_layout():
    """The tiles read the layout they checked against the codes: another one (here the codes'
    rows swapped) leaves the weight on tinygemm at every size."""
    weight = cases.random_int_weight(64, 64, 4, 32, False, seed=5)
    plane = CpuIntKernel(weight, prompt_path="tiles").planes[0]
    codes = unpack_codes(weight.codes, 4).to(torch.int32)
    assert int4_tiles.Int4Tiles.of(plane.packed, codes, plane.scale_zeros, 32) is not None
    swapped = codes.roll(1, dims=0)
    assert int4_tiles.Int4Tiles.of(plane.packed, swapped, plane.scale_zeros, 32) is None
    with pytest.raises(ValueError, match="4-bit prompt path 'fast'"):
        CpuIntKernel(weight, prompt_path="fast")


@pytest.mark.parametrize(
    ("tiles_s", "want"), [(0.5e-3, "tiles"), (0.99e-3, "tinygemm"), (None, "tinygemm")]
)
def test_the_prompt_path_is_what_measured_faster(tmp_path, tiles_s, want):
    """The measured choice (cpu_choice/decide.py's rule): the tiles where they beat tinygemm
    by the margin on the measured row counts, tinygemm on a near tie or a failed
    measurement."""
    from pagefleet.engine.cpu_choice.decide import Timed
    from pagefleet.engine.cpu_choice.measure import TimingCache

    cache = TimingCache(tmp_path / "choices.json")
    subject = "int4 prompt 64x64 group 32"
    rows = [f"rows={n}" for n in int4_tiles.MEASURED_ROWS]
    cache.put(subject, [Timed(r, {"tinygemm": 1e-3, "tiles": tiles_s or 1.0}) for r in rows])
    if tiles_s is None:
        cache.path.write_text("{}")  # nothing kept: measured now, with a failing candidate

        def measure(tinygemm, tiles):
            return [Timed(r, {"tinygemm": 1e-3, "tiles": None}) for r in rows]

        original = int4_tiles.measure_paths
        int4_tiles.measure_paths = measure
        try:
            got = int4_tiles.prompt_path(subject, None, object(), cache)
        finally:
            int4_tiles.measure_paths = original
    else:
        got = int4_tiles.prompt_path(subject, None, object(), cache)
    assert got == want


def _cpu_w8a8_kernels() -> dict:
    """The CPU's W8A8 kernels: oneDNN on unsigned nibbles (runs everywhere), on signed codes
    where this CPU sums them exactly, torch._int_mm where its sums are exact here."""
    found = {"onednn-nibbles": functools.partial(OneDnnInt8MatMul, signed=False)}
    if signed_codes_are_exact():
        found["onednn-signed"] = functools.partial(OneDnnInt8MatMul, signed=True)
    x = torch.full((1, 1024), 127, dtype=torch.int8)
    if torch.equal(torch._int_mm(x, x.t()).long(), x.long() @ x.long().t()):
        found["int_mm"] = kernels.Int8MatMul
    return found


@pytest.mark.parametrize("kernel", list(_cpu_w8a8_kernels()))
@pytest.mark.parametrize("input_scale", [None, 0.05], ids=["dynamic", "static"])
@pytest.mark.parametrize("cols", [256, NIBBLE_COLUMNS + 64], ids=["cols256", "past-a-slice"])
def test_int8_w8a8_kernels_give_the_exact_sums_scaled(kernel, input_scale, cols):
    """Each row's int8 codes times the weight's codes summed exactly, then Int8MatMul's two
    scalings in its order: the same floats bit for bit on every kernel and CPU. Row 0 is all
    +127 against a weight row of +127, whose pairs of products overflow int16 (the sum a CPU
    without VNNI forms); the nibble path's column slices are crossed."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randint(-127, 128, (40, cols), generator=gen, dtype=torch.int8)
    weight[0] = 127
    scale = torch.rand(40, generator=gen) + 0.5
    bias = torch.randn(40, generator=gen)
    x = torch.randn(2, 3, cols, generator=gen) * torch.arange(1, 7).reshape(2, 3, 1)
    x[0, 0] = 6.0 if input_scale is None else 127 * input_scale
    matmul = _cpu_w8a8_kernels()[kernel](weight, scale, input_scale)
    for inputs in (x, x.bfloat16()):
        codes, a = kernels.quantize_rows_int8(inputs.reshape(6, cols), input_scale)
        assert codes.abs().max() <= 127 and torch.all(codes[0] == 127)
        exact = (codes.long() @ weight.long().t()).to(torch.int32)
        want = ((exact * a).mul_(scale).to(inputs.dtype) + bias.to(inputs.dtype)).reshape(2, 3, 40)
        got = matmul(inputs, bias.to(inputs.dtype))
        assert got.dtype == inputs.dtype
        assert torch.equal(got, want)


def test_a_cpu_without_vnni_gets_exact_w8a8_sums():
    """oneDNN capped to AVX2 (what a CPU without VNNI runs: int16 pair sums, where
    torch._int_mm's sums come out wrong by millions): the engine's W8A8 kernel must notice on
    the real call and still give the exact sums."""
    script = (
        "import torch\n"
        "from pagefleet.engine.model.quant import kernels\n"
        "from pagefleet.engine.model.quant.cpu_int8 import signed_codes_are_exact\n"
        "w = torch.full((16, 1024), 127, dtype=torch.int8)\n"
        "x = torch.full((2, 1024), 3.0)\n"
        "got = kernels.scaled8_kernel(w, torch.ones(16), None)(x, None)\n"
        "exact = (torch.full((2, 16), 127 * 127 * 1024, dtype=torch.int32) * (3.0 / 127))\n"
        "assert torch.equal(got, exact), (got[0, 0].item(), exact[0, 0].item())\n"
        "print('signed', signed_codes_are_exact())\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "signed False" in done.stdout


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
