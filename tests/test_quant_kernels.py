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

import numpy as np
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
    "int4-g64-three-blocks-of-rows": (192, 128, 4, 64, False),
    "int4-act-order": (64, 128, 4, 32, True),
}


@pytest.mark.parametrize("name", list(TILE_CASES))
def test_steps_on_tiles_multiply_by_the_dequantized_weight(name, monkeypatch, tile_calls):
    """From a plane's `tile_rows` its steps run on the tiles (quant/int4_tiles.py), which
    read tinygemm's own packed bytes: the same product as tinygemm's to bfloat16 rounding,
    the dequantized weight's to the kernels' precision; fewer rows stay on tinygemm. A torch
    build whose layout the tiles do not read keeps every weight on tinygemm."""
    monkeypatch.setattr(int4_tiles, "TILE_BYTES", 2 * 128 * 64)  # tiles of 64 rows: several
    out, cols, bits, group, act_order = TILE_CASES[name]
    weight = cases.random_int_weight(out, cols, bits, group, act_order, seed=3)
    kernel = CpuIntKernel(weight)
    if int4_tiles.tinygemm_block() is None:
        assert all(plane.tiles is None for plane in kernel.planes)
        return
    for plane in kernel.planes:
        plane.tile_rows = 130
    x = torch.randn(133, cols, generator=torch.Generator().manual_seed(4))
    got = kernel(x)
    assert tile_calls == [133] * len(kernel.planes)
    want = x @ weight.dequantize().t()
    assert_close(got, want, atol=1e-2 * want.abs().max().item(), rtol=0)
    on_tinygemm = CpuIntKernel(weight)(x)  # tile_rows None: never the tiles
    # both round their sums to bfloat16: two of its steps at the output's scale
    assert_close(got, on_tinygemm, atol=2**-7 * want.abs().max().item(), rtol=0)
    tile_calls.clear()
    kernel(x[:129])
    assert not tile_calls


@pytest.mark.parametrize("threads", [1, 3, 7])
def test_the_tiles_are_the_weights_in_bfloat16_bit_for_bit(threads, monkeypatch):
    """Each tile is ((q - 8) * scale + zero) of tinygemm's bfloat16 scale and zero, rounded
    to bfloat16 as torch rounds: tiles of two blocks from a nonzero row, a shorter last one,
    an input width (160, groups of 32) that the threads split unevenly."""
    block = int4_tiles.tinygemm_block()
    if block is None:
        return  # this build's layout is not read (the test above checks the fallback)
    rows, k, group = 5 * block, 160, 32
    monkeypatch.setattr(int4_tiles, "TILE_BYTES", 2 * k * 2 * block)  # two blocks a tile
    gen = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.uint8)
    scale_zeros = (torch.randn(k // group, rows, 2, generator=gen) * 0.1).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
    tiles = int4_tiles.Int4Tiles.of(packed, scale_zeros, group)
    assert [stop - start for start, stop in tiles.tiles] == [2 * block, 2 * block, block]
    sz = scale_zeros.float().repeat_interleave(group, dim=0)  # [k, rows, 2]
    want = ((codes.t().float() - 8) * sz[..., 0] + sz[..., 1]).to(torch.bfloat16)
    for start, stop in tiles.tiles:
        out = np.empty((k, stop - start), np.uint16)
        int4_tiles._dequantize_tile(
            tiles.packed, tiles.scale_zeros, group, block, start, k, out, threads
        )
        got = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
        assert torch.equal(got.view(torch.int16), want[:, start:stop].view(torch.int16))


def test_tiles_decline_weights_without_whole_blocks():
    block = int4_tiles.tinygemm_block()
    if block is None:
        return
    codes = torch.randint(0, 16, (block + 16, 64), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    assert int4_tiles.Int4Tiles.of(packed, torch.zeros(2, block + 16, 2).bfloat16(), 32) is None
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes[:block], 2)
    with pytest.raises(ValueError, match="scale/zero pairs"):
        int4_tiles.Int4Tiles.of(whole, torch.zeros(3, block, 2).bfloat16(), 32)


ROW_CODE_CASES = {
    "int4-g32": (192, 96, 4, 32, False),
    "int4-g64": (128, 256, 4, 64, False),
    "int4-channel-asym": (64, 96, 4, None, False),  # one group of 96: three of 32 in tinygemm
    "int8-g32-sym": (64, 128, 8, 32, True),  # Q8_0's form: no offsets kept
    "int8-g32-asym": (128, 64, 8, 32, False),
}


@pytest.mark.parametrize("name", list(ROW_CODE_CASES))
def test_row_codes_multiply_as_the_dequantized_weight_in_float32(name):
    """One-row steps of the fused layers read the codes the kernel keeps (quant/row_codes.py:
    8-bit ones a byte each, 4-bit ones in tinygemm's packed plane itself): the float32 product
    of the dequantized weight up to the order of the sums (tinygemm, with bfloat16
    activations, is ~2^-8 off), bias added, or added into a residual in place; a bias of the
    wrong length is refused before the kernel reads past it."""
    out, cols, bits, group, symmetric = ROW_CODE_CASES[name]
    weight = cases.random_int_weight(out, cols, bits, group, False, seed=5)
    if symmetric:
        weight.offsets = -(1 << (bits - 1)) * weight.scales
    codes = CpuIntKernel(weight).row_codes()
    if bits == 4 and int4_tiles.tinygemm_block() != 64:
        assert codes is None  # a plane in another layout: not read in place
        return
    gen = torch.Generator().manual_seed(2)
    x, bias = torch.randn(1, cols, generator=gen), torch.randn(out, generator=gen)
    want = (x.double() @ weight.dequantize().double().t() + bias.double()).float()
    scale = want.abs().max().item()
    assert_close(codes(x, bias), want, atol=1e-6 * scale, rtol=0)
    residual = torch.randn(1, out, generator=gen)
    expected = residual + want
    assert codes.one_row(x, None, bias, residual) is residual
    assert_close(residual, expected, atol=1e-6 * scale, rtol=0)
    assert (codes.offsets.size == 0) == symmetric
    with pytest.raises(ValueError, match="one float32 row"):
        codes(torch.randn(2, cols))
    with pytest.raises(ValueError, match="a bias of"):
        codes(x, bias[:1])


@pytest.mark.parametrize("block", [64, 32], ids=["avx512-layout", "avx2-layout"])
def test_4_bit_planes_in_either_tinygemm_layout_multiply_in_float32(block):
    """tinygemm packs blocks of 64 rows on AVX-512 builds and 32 on AVX2 ones (byte i of a
    column: row i low, row B/2 + i high); the one-row kernel reads either in place. The
    layout written here is checked against this build's own packing where it is the same."""
    from pagefleet.engine.model.quant.row_codes import PlaneCodes

    rows, cols, group, out = 3 * block, 96, 32, 3 * block - 5
    gen = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    by_column = codes.view(rows // block, block, cols).permute(0, 2, 1)  # [blocks, cols, B]
    half = block // 2
    packed = (by_column[..., :half] | (by_column[..., half:] << 4)).contiguous()
    packed = packed.view(rows, cols // 2)
    if int4_tiles.tinygemm_block() == block:
        theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        assert torch.equal(theirs.view(torch.uint8), packed)
    scales = torch.rand(out, cols // group, generator=gen) * 0.02 + 0.001
    offsets = torch.randn(out, cols // group, generator=gen) * 0.05
    plane = PlaneCodes.of(packed, block, scales, offsets)
    dense = codes[:out].double() * scales.double().repeat_interleave(group, 1)
    dense += offsets.double().repeat_interleave(group, 1)
    x, bias = torch.randn(1, cols, generator=gen), torch.randn(out, generator=gen)
    want = (x.double() @ dense.t() + bias.double()).float()
    assert_close(plane(x, bias), want, atol=1e-6 * want.abs().max().item(), rtol=0)
    short = rows - 16  # not whole blocks
    assert PlaneCodes.of(packed[:short], block, scales[: out - 16], offsets[: out - 16]) is None


def test_row_codes_decline_gathered_columns_and_rows_short_of_a_block():
    for bits in (4, 8):
        act_order = cases.random_int_weight(64, 64, bits, 32, True, seed=1)
        assert CpuIntKernel(act_order).row_codes() is None
    short = cases.random_int_weight(80, 64, 4, 32, False, seed=1)  # tinygemm pads to 80
    assert CpuIntKernel(short).row_codes() is None


@pytest.mark.parametrize("act_order", [False, True], ids=["groups", "act-order"])
def test_8_bit_codes_multiply_in_float32_on_every_path(act_order, monkeypatch):
    """Grouped 8-bit codes (GGUF Q8_0, GPTQ int8) run on their bytes with float32 activations:
    one row, a few (each code read once for all rows) and, from the measured row count, float32
    tiles of a few blocks each; every path is the dequantized weight's float32 product up to
    the order of the sums, not the 2^-8 of bfloat16 activations."""
    from pagefleet.engine.model.quant import row_codes

    monkeypatch.setattr(row_codes, "TILE_BYTES", 4 * 96 * 64 * 2)  # two blocks a tile
    weight = cases.random_int_weight(200, 96, 8, 32, act_order, seed=9)  # 4 blocks, last short
    kernel = CpuIntKernel(weight)
    assert kernel.codes is not None and not kernel.planes
    dense = weight.dequantize().double()
    gen = torch.Generator().manual_seed(3)
    for tile_rows in (None, 5):
        kernel.codes.tile_rows = tile_rows
        for rows in (1, 4, 9):
            x = torch.randn(rows, 96, generator=gen)
            want = (x.double() @ dense.t()).float()
            assert_close(kernel(x), want, atol=1e-5 * want.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="float32 rows"):
        kernel.codes.codes.matmul(torch.randn(2, 95))


def test_exact_int8_codes_are_found_only_in_a_float_weight_that_holds_them():
    """A GGUF Q8_0 tensor dequantized at load holds its codes exactly (the tied LM head of
    a Q8_0 embedding reads them at one row); any other float weight stays float."""
    import gguf
    from gguf import GGMLQuantizationType as T

    from pagefleet.engine.model.quant.row_codes import RowCodes

    values = np.random.default_rng(3).standard_normal((96, 128)).astype(np.float32)
    values[5, :32] = 0  # an all-zero block
    blocks = gguf.quants.quantize(values, T.Q8_0)
    weight = torch.from_numpy(gguf.quants.dequantize(blocks, T.Q8_0).astype(np.float32))
    codes = RowCodes.exact_int8(weight)
    assert codes is not None and codes.offsets.size == 0
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(0))
    assert_close(codes(x), x @ weight.t(), atol=1e-5, rtol=1e-5)
    nudged = weight.clone()
    nudged[7, 40] = torch.nextafter(nudged[7, 40], torch.tensor(10.0))
    assert RowCodes.exact_int8(nudged) is None
    assert RowCodes.exact_int8(torch.from_numpy(values)) is None
    broken = weight.clone()
    broken[0, 0] = float("nan")
    assert RowCodes.exact_int8(broken) is None


def _timed(tiles_over_tinygemm: dict[int, float | None]):
    from pagefleet.engine.cpu_choice.decide import Timed

    return [
        Timed(f"rows={rows}", {"tinygemm": 1e-3, "tiles": None if r is None else r * 1e-3})
        for rows, r in tiles_over_tinygemm.items()
    ]


@pytest.mark.parametrize(
    ("ratios", "want"),
    [
        ({128: 0.5, 256: 0.4, 512: 0.3}, 128),
        ({128: 1.9, 256: 0.8, 512: 0.3}, 256),  # slower at 128 rows: from 256
        ({128: 0.5, 256: 1.2, 512: 0.3}, 512),  # a loss at 256 bars the counts below it
        ({128: 0.5, 256: 0.5, 512: 0.99}, None),  # a near tie at the largest: tinygemm
        ({128: 0.5, 256: 0.5, 512: None}, None),  # a failed measurement: tinygemm
    ],
)
def test_tiles_take_steps_from_where_they_measured_faster(ratios, want):
    rows, reason = int4_tiles.tile_rows(_timed(ratios))
    assert rows == want
    assert "rows=512" in reason


def test_the_load_sets_tile_rows_from_the_kept_times(tmp_path):
    """One measurement per shape, read back from the per-machine cache: every plane of that
    shape takes the same threshold."""
    from pagefleet.engine.cpu_choice.measure import TimingCache

    weights = [cases.random_int_weight(64, 64, 4, 32, False, seed=s) for s in (1, 2)]
    kernels = [CpuIntKernel(w) for w in weights]
    if kernels[0].planes[0].tiles is None:
        return
    cache = TimingCache(tmp_path / "choices.json")
    cache.put("int4 tiles 64x64 group 32", _timed({128: 1.5, 256: 0.5, 512: 0.2}))
    int4_tiles.choose_tile_rows([k.planes[0] for k in kernels], cache)
    assert [k.planes[0].tile_rows for k in kernels] == [256, 256]


def test_8_bit_codes_take_tiles_from_the_kept_times(tmp_path):
    from pagefleet.engine.cpu_choice.decide import Timed
    from pagefleet.engine.cpu_choice.measure import TimingCache

    kernel = CpuIntKernel(cases.random_int_weight(64, 64, 8, 32, False, seed=1))
    cache = TimingCache(tmp_path / "choices.json")
    times = {16: 2.0, 64: 0.8, 256: 0.3}  # tiles / codes
    cache.put(
        "int8 code tiles 64x64 group 32",
        [Timed(f"rows={n}", {"codes": 1e-3, "tiles": r * 1e-3}) for n, r in times.items()],
    )
    int4_tiles.choose_tile_rows([kernel.codes], cache)
    assert kernel.codes.tile_rows == 64


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
