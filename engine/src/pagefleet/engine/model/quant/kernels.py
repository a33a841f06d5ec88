"""Which kernel multiplies a quantized weight, by device: the one place that choice is made.

- Weight-only integer codes (`IntWeight`): torch's packed CPU kernels (quant/cpu_kernels.py)
  or the Triton W4A16/W8A16 kernel on a GPU (quant/triton_kernels.py).
- W8A8 (quant/scaled8.py): FP8 through `torch._scaled_mm` on GPUs of compute capability 8.9
  and above (refused below, with the reason); INT8, and FP8 on a CPU (requantized to INT8 per
  row: CPUs have no FP8 GEMM), through oneDNN's prepacked int8 linear on CPUs
  (quant/cpu_int8.py: exact with or without VNNI), `torch._int_mm` on GPUs.
"""

from __future__ import annotations

import torch

from pagefleet.engine.model.quant.int_weight import IntWeight

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
INT8_MAX = 127.0
FP8_MIN_CAPABILITY = (8, 9)
CUDA_INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA wants more than 16 rows


def int_kernel(weight: IntWeight):
    """The kernel for a weight-only integer matrix on its device."""
    if weight.codes.device.type == "cuda":
        return TritonIntKernel(weight)
    from pagefleet.engine.model.quant.cpu_kernels import CpuIntKernel

    return CpuIntKernel(weight)


class TritonIntKernel:
    """y = x W^T through quant/triton_kernels.py (any group size; act-order gathered)."""

    def __init__(self, weight: IntWeight) -> None:
        sizes = (weight.group_size, 16) if weight.g_idx is not None else (weight.group_size,)
        self.grouped = weight.contiguous_groups(sizes)
        self.out_features = weight.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from pagefleet.engine.model.quant.triton_kernels import int_weight_matmul

        g = self.grouped
        shape = x.shape
        x2 = g.gather(x.reshape(-1, shape[-1])).contiguous()
        y = int_weight_matmul(x2, g.codes, g.scales, g.offsets, g.group_size, g.bits)
        return y.reshape(*shape[:-1], self.out_features)

    def tensors(self) -> list[torch.Tensor]:
        g = self.grouped
        return [g.codes, g.scales, g.offsets] + ([g.index] if g.index is not None else [])


def scaled8_kernel(weight: torch.Tensor, scale: torch.Tensor, input_scale: float | None):
    """The W8A8 kernel for an 8-bit weight `[out, in]` (FP8 e4m3 or int8) with a float32
    scale per row and, for static activations, the per-tensor input scale."""
    fp8 = weight.dtype == FP8_DTYPE
    if weight.device.type == "cuda" and fp8:
        check_fp8_capability(weight.device)
        return Fp8MatMul(weight, scale, input_scale)
    if fp8:  # CPU: the same bytes as INT8 per row; a static FP8 scale spans +-448 of them
        weight, scale = requantize_int8_per_row(weight, scale)
        input_scale = None if input_scale is None else input_scale * FP8_MAX / INT8_MAX
    if weight.device.type == "cpu":
        from pagefleet.engine.model.quant.cpu_int8 import OneDnnInt8MatMul, onednn_int8_available

        if onednn_int8_available():
            return OneDnnInt8MatMul(weight, scale, input_scale)
    return Int8MatMul(weight, scale, input_scale)


def check_fp8_capability(device: torch.device) -> None:
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"FP8 weights need a GPU of compute capability 8.9 or newer (FP8 tensor cores: "
            f"Ada, Hopper, Blackwell); {torch.cuda.get_device_name(device)} is "
            f"{capability[0]}.{capability[1]}. Serve a GPTQ/AWQ or INT8 checkpoint instead"
        )


def requantize_int8_per_row(
    weight: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows (value * scale) as int8 codes with a new scale per row."""
    values = weight.float() * scale[:, None]
    row_scale = (values.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)
    codes = torch.round(values / row_scale[:, None]).clamp(-128, 127).to(torch.int8)
    return codes, row_scale


def _token_scales(x: torch.Tensor, largest: float) -> torch.Tensor:
    """Each row's scale mapping its largest magnitude to `largest` (float32 `[rows, 1]`)."""
    return (x.abs().amax(dim=-1, keepdim=True).float() / largest).clamp(min=1e-12)


def quantize_rows_int8(
    x: torch.Tensor, input_scale: float | None
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """Activations `[rows, in]` as int8 codes and their scale: per row (dynamic: each row's
    largest magnitude maps to 127, so no code can leave the range) or the static one."""
    if input_scale is not None:
        codes = (x.float() * (1.0 / input_scale)).round_().clamp_(-128, 127)
        return codes.to(torch.int8), input_scale
    if x.dtype == torch.float32 and x.device.type == "cpu":
        from pagefleet.engine.model.quant import int8_numba  # only where a CPU step needs it

        if int8_numba.kernels_take(x):
            return int8_numba.int8_rows(x)  # the same codes and scales, in one call
    largest = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-12)
    codes = (x * (INT8_MAX / largest)).round_().to(torch.int8)
    return codes, largest.mul_(1.0 / INT8_MAX)


def scale_sums(
    acc: torch.Tensor,
    a: torch.Tensor | float,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A W8A8 product's output from its integer sums `[rows, out]` (int32, or float32 holding
    integers): float(sum) * row scale * column scale, then the bias, in `dtype`: the order
    every W8A8 kernel keeps, so each gives the same floats bit for bit."""
    if isinstance(a, torch.Tensor) and dtype == torch.float32 and acc.device.type == "cpu":
        from pagefleet.engine.model.quant import int8_numba

        if int8_numba.kernels_take(acc, a, bias):
            return int8_numba.scale_sums(acc.float(), a, scale, bias)
    y = (acc * a).mul_(scale).to(dtype)  # int32 x float32 -> float32
    return y if bias is None else y + bias


class Int8MatMul:
    """INT8 W8A8: activations to int8 per token (or by the static scale), int8 x int8 ->
    int32 through torch._int_mm, then both scales. The GPU's kernel: on a CPU without VNNI,
    torch._int_mm's sums saturate (quant/cpu_int8.py)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, input_scale: float | None):
        self.weight = weight.contiguous()
        self.scale = scale.float()
        self.input_scale = input_scale

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        xq, a = quantize_rows_int8(x.reshape(-1, shape[-1]), self.input_scale)
        rows = xq.shape[0]
        if x.device.type == "cuda" and rows < CUDA_INT_MM_MIN_ROWS:
            xq = torch.nn.functional.pad(xq, (0, 0, 0, CUDA_INT_MM_MIN_ROWS - rows))
        acc = torch._int_mm(xq, self.weight.t())[:rows]
        y = scale_sums(acc, a, self.scale, bias, dtype)
        return y.reshape(*shape[:-1], self.weight.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scale]


class Fp8MatMul:
    """FP8 W8A8 on a GPU: activations to e4m3 per token (or by the static scale), one
    torch._scaled_mm with row-wise scales on both sides."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, input_scale: float | None):
        self.weight = weight.contiguous()
        self.scale = scale.float().reshape(1, -1)
        self.input_scale = input_scale

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        if self.input_scale is None:
            a = _token_scales(x2, FP8_MAX)
        else:
            a = torch.full((x2.shape[0], 1), self.input_scale, device=x.device)
        xq = (x2.float() / a).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        # Row-wise scaling wants a bfloat16 output; the model's dtype follows.
        y = torch._scaled_mm(
            xq, self.weight.t(), scale_a=a, scale_b=self.scale, out_dtype=torch.bfloat16
        )
        y = y.to(dtype) if bias is None else y.to(dtype) + bias
        return y.reshape(*shape[:-1], self.weight.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scale]
