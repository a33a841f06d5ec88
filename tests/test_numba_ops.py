"""The small per-layer ops' numba kernels (model/numba_ops.py) a float32 CPU step runs.

The rotation must be bit for bit HF's (x * cos + rotate_half(x) * sin), full and partial,
on the strided q/k views a fused q/k/v projection gives; the norm must be torch's RMSNorm to
float32 rounding; the layers must take the kernels only where they apply (float32 on the
CPU, no gradients wanted) and keep torch's ops elsewhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagefleet.engine.model import numba_ops
from pagefleet.engine.model.layers import RMSNorm
from pagefleet.engine.model.quant import int8_numba
from pagefleet.engine.model.quant.cpu_int8 import OneDnnInt8MatMul
from pagefleet.engine.model.quant.kernels import quantize_rows_int8
from pagefleet.engine.model.rope import RotaryEmbedding


def hf_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama's apply_rotary_pos_emb on [tokens, heads, dims] with partial rotation."""
    rotary = cos.shape[-1]
    rot, passed = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotate_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotate_half * sin, passed), dim=-1)


@pytest.mark.parametrize("partial", [1.0, 0.25])
def test_the_rotation_is_bit_for_bit_hfs(partial):
    head_dim, heads, kv_heads, tokens = 64, 6, 2, 37
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    rope = RotaryEmbedding(head_dim, 512, params)
    positions = torch.randint(0, 512, (tokens,))
    rotation = rope.at(positions, torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 3
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)  # strided
    half_cos = rope.cos[positions].unsqueeze(1)
    half_sin = rope.sin[positions].unsqueeze(1)
    cos, sin = torch.cat((half_cos, half_cos), -1), torch.cat((half_sin, half_sin), -1)
    ours_q, ours_k = rotation(q, k)
    assert torch.equal(ours_q, hf_rotation(q, cos, sin))
    assert torch.equal(ours_k, hf_rotation(k, cos, sin))
    kernel_q, kernel_k = numba_ops.rotate(q, k, rotation.cos, rotation.sin)
    assert torch.equal(kernel_q, ours_q) and torch.equal(kernel_k, ours_k)  # the kernel ran


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_the_norm_is_torchs_to_float32_rounding(rows):
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    wide = torch.randn(rows, 2 * 576) * 4
    x = wide[:, ::2]  # a strided view as well
    with torch.inference_mode():
        ours = norm(x)
    assert torch.equal(ours, numba_ops.rms_norm(x, norm.weight, 1e-5))  # the kernel ran
    torch.testing.assert_close(ours, F.rms_norm(x, (576,), norm.weight, 1e-5), rtol=2e-6, atol=2e-6)


def test_other_dtypes_gradients_and_odd_shapes_keep_torchs_ops():
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(3, 64)
    half = x.to(torch.bfloat16)
    assert torch.equal(norm.to(torch.bfloat16)(half), F.rms_norm(half, (64,), norm.weight, 1e-6))
    norm = RMSNorm(64, 1e-6)
    learning = x.clone().requires_grad_()
    norm(learning).sum().backward()  # autograd still sees the op, for the input
    assert learning.grad is not None and norm.weight.grad is not None
    norm.weight.grad = None
    norm(x).sum().backward()  # and for the weight alone
    assert norm.weight.grad is not None
    with torch.no_grad():
        assert numba_ops.norm_applies(x, norm.weight)
        assert not numba_ops.norm_applies(half, norm.weight)
        assert not numba_ops.norm_applies(torch.randn(3, 32), norm.weight)  # torch raises
    with pytest.raises(RuntimeError), torch.no_grad():
        norm(torch.randn(3, 32))
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    one_row = torch.ones(1, 1, 8)  # broadcast over the tokens by torch; not the kernel's case
    with torch.no_grad():
        assert numba_ops.rotation_applies(q, k, torch.ones(4, 1, 8))
        assert not numba_ops.rotation_applies(q, k, one_row)
        assert not numba_ops.rotation_applies(q, k, torch.ones(4, 1, 16))
        assert not numba_ops.rotation_applies(q.bfloat16(), k.bfloat16(), one_row.bfloat16())


def test_int8_activation_codes_and_scales_are_bit_for_bit_torchs():
    """The W8A8 CPU kernel's one-call quantization must give quantize_rows_int8's codes and
    scales exactly: a code off by one at a rounding tie flips later layers' codes and, over a
    model's layers, whole tokens. Rows hold halves (ties, rounded to even), a zero row (the
    1e-12 floor), a NaN, an inf, a value that tells torch's factor from a plain division, and
    magnitudes from 1e-20 to 1e20."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 333, generator=gen) * torch.logspace(-3, 3, 7).unsqueeze(1)
    x[1] = torch.round(x[1] * 2) / 2
    x[2] = torch.arange(333) % 254 - 126.5  # largest 126.5: not a tie...
    x[2, 0] = 127.0  # ...but with 127 the factor is exactly 1.0, so every k + 0.5 is one
    x[3] = 0.0
    assert (x[2] * (x[2].abs().max().reciprocal() * 127) % 1 == 0.5).sum() > 100
    x[4, 5], x[5, 7] = float("nan"), float("inf")  # a NaN spreads over its row; inf -> 0s
    # a row whose code differs between reciprocal(largest) * 127 (torch's) and 127 / largest
    x[6], x[6, 0], x[6, 1] = 0.0, 0.9847743511199951, 0.0116311926394701
    largest = x[6, :1]
    assert torch.round(x[6, 1] * (largest.reciprocal() * 127)) != torch.round(
        x[6, 1] * (torch.tensor(127.0) / largest)
    )
    wide = torch.randn(2000, 64, generator=gen) * torch.logspace(-20, 20, 2000).unsqueeze(1)
    for rows in (x, wide):  # the wide sweep tells 1/127 apart from a division by 127
        codes, scales = int8_numba.int8_rows(rows)
        want_codes, want_scales = quantize_rows_int8(rows, None)
        assert codes.dtype == torch.int8 and torch.equal(codes, want_codes)
        torch.testing.assert_close(scales, want_scales, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_sums_are_scaled_as_torch_rounds_them(with_bias):
    gen = torch.Generator().manual_seed(4)
    sums = torch.randint(-(2**22), 2**22, (5, 48), generator=gen).float()
    row_scales, scales = torch.rand(5, 1, generator=gen), torch.rand(48, generator=gen)
    bias = torch.randn(48, generator=gen) if with_bias else None
    want = (sums * row_scales).mul_(scales)
    want = want if bias is None else want + bias
    assert torch.equal(int8_numba.scale_sums(sums, row_scales, scales, bias), want)


def test_a_w8a8_input_that_wants_a_gradient_keeps_torchs_ops():
    """Outside inference mode a norm's weight wants a gradient, so the next linear's input
    does too: the int8 kernel must not take it (numpy refuses such tensors) and must give the
    same floats as for the same input without one."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randint(-127, 128, (16, 64), generator=gen, dtype=torch.int8)
    matmul = OneDnnInt8MatMul(weight, torch.rand(16, generator=gen) + 0.5, None)
    x = torch.randn(3, 64, generator=gen)
    got = matmul(x.clone().requires_grad_(), None)
    assert got.requires_grad
    assert torch.equal(got.detach(), matmul(x, None))


@pytest.mark.parametrize("shape", [(37, 19), (576, 1536)], ids=["odd", "down-proj"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_the_one_row_gemv_is_torchs_linear_to_float32_rounding(shape, with_bias, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(*shape, generator=gen)
    x = torch.randn(1, shape[1], generator=gen)
    bias = torch.randn(shape[0], generator=gen) if with_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    calls = []
    kernel = numba_ops._gemv
    monkeypatch.setattr(numba_ops, "_gemv", lambda *a: calls.append(1) or kernel(*a))
    got = numba_ops.linear_one_row(x, weight, bias)
    assert got.shape == (1, shape[0]) and got.dtype == torch.float32
    tolerance = 1e-6 * shape[1] ** 0.5 * 4  # float32 sums of K products of unit normals
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=tolerance)
    residual = torch.randn(1, shape[0], generator=gen)
    into = residual.clone()
    added = numba_ops.linear_one_row(x, weight, bias, into)
    assert added.data_ptr() == into.data_ptr()  # in place, as the fused residual add is
    torch.testing.assert_close(
        added.double(), residual.double() + expected, rtol=1e-5, atol=tolerance
    )
    assert len(calls) == 2  # the kernel ran, not torch's fallback


def test_the_gemv_leaves_gradients_and_strided_outputs_to_torch():
    weight, x = torch.randn(8, 4), torch.randn(1, 4, requires_grad=True)
    out = numba_ops.linear_one_row(x, weight, None)
    assert out.grad_fn is not None  # autograd recorded: torch's linear ran
    residual = torch.zeros(1, 16)[:, ::2]  # (1, 8), every other element
    assert not residual.is_contiguous()
    with torch.no_grad():
        got = numba_ops.linear_one_row(x, weight, None, residual)
    assert got.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(got, F.linear(x.detach(), weight))


def test_the_gemv_never_reads_past_a_mismatched_shape_or_writes_over_its_input():
    weight = torch.randn(8, 4)
    with pytest.raises(RuntimeError):  # torch's error, not a read past x's end
        numba_ops.linear_one_row(torch.randn(1, 3), weight, None)
    with pytest.raises(RuntimeError):
        numba_ops.linear_one_row(torch.randn(1, 4), weight, torch.randn(5))
    square = torch.randn(4, 4)
    row = torch.randn(1, 4)
    expected = row + F.linear(row, square)
    got = numba_ops.linear_one_row(row, square, None, row)  # x is the residual itself
    torch.testing.assert_close(got, expected)
