"""Linear layers with float8 weights (`talker.fp8_weights`): half the bytes a matmul reads.

A served talker step at a hundred rows is bound by reading its weights (an H200's backbone
matmuls at 88 rows run at ~65% of the memory bandwidth), so the same products from float8
weights could take about half the time. `Fp8Linear` holds `W [out, in]` as float8 e4m3 with one
fp32 scale per output row (`W ≈ weight_fp8 * weight_scale`) and multiplies by one of two schemes
(`talker.fp8_scheme`):

* "w8a16" (the default): the input stays as it is; on CUDA a Triton kernel made for few rows
  (`stages.runtime.fp8_matmul`) upcasts the weights' tiles in registers, elsewhere torch
  multiplies by the upcast weights. Only the weights are rounded.
* "w8a8": the input is quantized per row at run time too (one scale per row, from the row's
  largest magnitude) and the float8 products are summed in fp32: "dynamic per token, per
  channel", the scheme of the peers' FP8 checkpoints without block scales. The product runs
  through `torch._scaled_mm` with unit scales (cuBLAS's per-tensor float8 kernels) and the
  row's and channel's scales multiply its output after, in the same kernel as what follows
  once compiled: on an H200 the per-tensor kernels take 0.62-0.65x bf16's matmul time at
  16-96 rows, the kernels cuBLAS picks for per-row and per-channel scales 1.05-1.19x
  (docs/performance-history.md).

Precision: e4m3 keeps 3 mantissa bits, so each quantized value is within 1/16 of itself; on
random inputs one product lands ~4% from the full-precision one with both operands quantized.
What that does to a model's outputs is measured, not assumed (`bench.kernels.fp8_fidelity`,
docs/performance.md).

`quantize_linears(module, names, scheme)` swaps the named linears of a module for `Fp8Linear`s
after loading (serving only: the state dict no longer has the checkpoint's weights). One device:
a tensor-parallel linear is refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from stages.runtime.linears import replace_linears


FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
AMAX_FLOOR = 1e-12  # the smallest row magnitude a scale is made from: an all-zero row gives zeros back
SCHEMES = ("w8a16", "w8a8")


def has_fp8_matmuls(device: str | torch.device) -> bool:
    """Whether `device` multiplies float8 (the CPU, or CUDA from compute capability 8.9 on)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type == "cpu"
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale [M, 1] fp32) with x ≈ x_fp8 * scale, row by row."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=AMAX_FLOOR)  # [M, 1]
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """y [..., out] = x [..., in] @ W^T (+ bias), W in float8 with a scale per output row; x
    quantized per row at run time too with `scheme` "w8a8"; y in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, scheme: str = "w8a16") -> None:
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"float8 scheme {scheme!r}: one of {SCHEMES}")
        w_fp8, w_scale = quantize_rows(weight.detach())  # [out, in], [out, 1]
        if w_fp8.shape[0] % 16 or w_fp8.shape[1] % 16:
            raise ValueError(f"a float8 matmul needs sizes divisible by 16, not {tuple(w_fp8.shape)}")
        self.register_buffer("weight_fp8", w_fp8)  # [out, in]
        self.register_buffer("weight_scale", w_scale.t().contiguous())  # [1, out] fp32
        self.register_buffer("unit_scale", torch.ones((), device=w_fp8.device), persistent=False)  # [] fp32
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = w_fp8.shape[1], w_fp8.shape[0]
        self.scheme = scheme
        # the Triton kernels (CUDA): imported when a float8 layer is made, not with the model, so
        # a process that serves bf16 never imports Triton (tests choose its CPU interpreter first)
        from stages.runtime import fp8_matmul

        self.kernels = fp8_matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if self.scheme == "w8a16":
            if x.is_cuda:
                y = self.kernels.w8a16_mm(x2.contiguous(), self.weight_fp8, self.weight_scale.view(-1))  # [M, out]
            else:
                y = (x2 @ self.weight_fp8.to(x.dtype).t()) * self.weight_scale.to(x.dtype)
        else:
            y = self.from_quantized(*quantize_rows(x2), x.dtype)  # [M, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def raw_product(self, x_fp8: torch.Tensor) -> torch.Tensor:
        """w8a8: x_fp8 [M, in] -> its product with weight_fp8 before either's scales [M, out] (bf16
        on CUDA: |raw| <= in * 448^2, well inside its range; fp32 elsewhere)."""
        # weight_fp8 [out, in] row-major, transposed: the column-major second operand
        return torch._scaled_mm(x_fp8, self.weight_fp8.t(), scale_a=self.unit_scale, scale_b=self.unit_scale,
                                out_dtype=torch.bfloat16 if x_fp8.is_cuda else torch.float32)

    def product(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w8a8: x [M, in] quantized per row and multiplied -> (raw [M, out], x_scale [M, 1]
        fp32); the layer's output without its bias is `raw * (x_scale * weight_scale)`, left to
        the caller (`stages.runtime.fp8_swiglu` applies it in the kernel that reads raw)."""
        x_fp8, x_scale = quantize_rows(x)
        return self.raw_product(x_fp8), x_scale

    def from_quantized(self, x_fp8: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """w8a8 from inputs already quantized per row: x_fp8 [M, in], x_scale [M, 1] fp32 ->
        y [M, out] in `dtype`, without the bias."""
        return (self.raw_product(x_fp8) * (x_scale * self.weight_scale)).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8 e4m3, {self.scheme}"


def as_fp8(linear: nn.Module, scheme: str = "w8a16") -> Fp8Linear:
    """The float8 twin of a `nn.Linear` (tensor-parallel linears are refused: one device)."""
    if isinstance(linear, Fp8Linear):
        return linear
    if type(linear) is not nn.Linear:
        raise TypeError(f"float8 weights replace nn.Linear layers, not {type(linear).__name__}")
    return Fp8Linear(linear.weight, linear.bias, scheme)


def quantize_linears(module: nn.Module, names: Iterable[str], scheme: str = "w8a16") -> int:
    """Replace every submodule of `module` whose own name is in `names` (e.g. "q_proj",
    "gate_up_proj") by its `Fp8Linear`; returns how many were replaced."""
    return replace_linears(module, names, lambda linear: as_fp8(linear, scheme), Fp8Linear)
