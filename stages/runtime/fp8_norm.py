"""A float8 layer's residual sum, RMSNorm and row quantization in one Triton kernel (`talker.fp8_fused_norms`).

With the backbone's matmuls from float8 weights by the w8a8 scheme (`stages.runtime.fp8_linear`)
and their scales left to the kernels after them (`talker.fp8_fused_scales`), each layer runs two
norms whose outputs feed a float8 matmul: the post-attention norm after `x + o_proj(o)`, and the
next layer's input norm after the MLP's output is added. Compiled, inductor makes each the
scale multiply, the sum, the norm, the row's largest magnitude and the float8 values in one
reduction kernel (on an H200 at 48 rows 3.6 and 4.25-5.5 us a layer, against 1.9 and 3.2 for
the bf16 norms alone). Here one program a row does it in one pass over the row in registers:

    s = x + raw * (row_scale * col_scale)       (stored, rounded to x's dtype: the new residual)
    h = weight * (s / rms(s))                   (rounded as `rms_norm` rounds, in x's dtype)
    h_fp8, h_scale = quantize_rows(h)           (one scale a row, float8 e4m3)

`raw` is a float8 product before its scales (`Fp8Linear.product`). The sum is rounded once a
half layer: the residual after attention and after the MLP, as the model without deferred sums
keeps it.

The kernel is a custom op (`torch.library.custom_op`, with its outputs' shapes for tracing), so
a compiled layer half calls it without a graph break and the decode graphs capture its launch.
It runs on CUDA, or on the CPU under Triton's interpreter (the tests); elsewhere
`add_rms_norm_quant` takes the torch ops (`add_rms_norm_quant_torch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import custom_op

from stages.runtime.batch_invariant import rms_norm
from stages.runtime.fp8_linear import AMAX_FLOOR, FP8, FP8_MAX, quantize_rows


@triton.jit
def _add_rms_norm_quant_kernel(
    x_ptr, stride_x,  # the residual [N, H]
    raw_ptr, stride_raw,  # a float8 product before its scales [N, H]
    row_scale_ptr,  # its rows' scales [N] fp32
    col_scale_ptr,  # its channels' scales [H] fp32
    weight_ptr,  # the norm's weight [H]
    sum_ptr, stride_sum,  # x + the scaled product [N, H], x's dtype
    out_ptr, stride_out,  # the normed sum in float8 [N, H]
    out_scale_ptr,  # its rows' scales [N] fp32
    H, eps, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
):
    """Program m: row m's sum stored, normed, quantized with one scale."""
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < H
    x = tl.load(x_ptr + m * stride_x + cols, mask=keep, other=0.0)
    raw = tl.load(raw_ptr + m * stride_raw + cols, mask=keep, other=0.0).to(tl.float32)
    scale = tl.load(row_scale_ptr + m) * tl.load(col_scale_ptr + cols, mask=keep, other=0.0)
    s = (x.to(tl.float32) + raw * scale).to(x.dtype)  # the new residual, rounded as stored
    tl.store(sum_ptr + m * stride_sum + cols, s, mask=keep)
    s32 = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s32 * s32, 0) / H + eps)
    weight = tl.load(weight_ptr + cols, mask=keep, other=0.0)
    # as rms_norm: the normalised value in x's dtype, times the weight, the product rounded to
    # their dtype (multiplied in fp32: what a bf16 product is on the GPU, and Triton's CPU
    # interpreter multiplies bf16 tensors wrongly)
    normed = (s32 * inv).to(x.dtype).to(tl.float32)
    h = (weight.to(tl.float32) * normed).to(weight.dtype).to(tl.float32)
    h_scale = tl.maximum(tl.max(tl.abs(h), 0), TINY) / FP8_MAX
    q = tl.minimum(tl.maximum(h / h_scale, -FP8_MAX), FP8_MAX)
    tl.store(out_ptr + m * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=keep)
    tl.store(out_scale_ptr + m, h_scale)


def _warps(block: int) -> int:
    """Warps for a row of `block` columns: 8 of each fp32 row vector a thread (256 columns a warp)."""
    return max(1, min(16, block // 256))


@custom_op("mossvox::fp8_add_rms_norm_quant", mutates_args=())
def add_rms_norm_quant_kernel(x: torch.Tensor, raw: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                              weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] (the residual), raw [N, H] (a float8 product before its scales), row_scale [N, 1]
    and col_scale [H] fp32 (its scales), the norm's weight [H] -> (s [N, H] in x's dtype, s normed
    in float8 [N, H], its rows' scales [N, 1] fp32): one kernel launch (CUDA, or Triton's
    interpreter)."""
    n, h = x.shape
    out_sum = torch.empty_like(x)
    out = torch.empty((n, h), dtype=FP8, device=x.device)
    out_scale = torch.empty((n, 1), dtype=torch.float32, device=x.device)
    launch_add_rms_norm_quant(x, raw, row_scale, col_scale, weight, eps, out_sum, out, out_scale)
    return out_sum, out, out_scale


def launch_add_rms_norm_quant(x: torch.Tensor, raw: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                              weight: torch.Tensor, eps: float, out_sum: torch.Tensor, out: torch.Tensor,
                              out_scale: torch.Tensor, num_warps: int | None = None) -> None:
    """`add_rms_norm_quant_kernel` into out_sum, out and out_scale; `num_warps`: a program's warps
    (None: 256 columns a warp; `bench.kernels.fp8_kernels` times others)."""
    n, h = x.shape
    if n == 0:
        return
    block = triton.next_power_of_2(h)
    _add_rms_norm_quant_kernel[(n,)](x, x.stride(0), raw, raw.stride(0), row_scale, col_scale, weight,
                                     out_sum, out_sum.stride(0), out, out.stride(0), out_scale, h, eps,
                                     BLOCK=block, FP8_MAX=FP8_MAX, TINY=AMAX_FLOOR,
                                     num_warps=num_warps or _warps(block))


@add_rms_norm_quant_kernel.register_fake
def _(x: torch.Tensor, raw: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
      weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs' shapes for tracing (torch.compile)."""
    n, h = x.shape
    return torch.empty_like(x), x.new_empty((n, h), dtype=FP8), x.new_empty((n, 1), dtype=torch.float32)


def add_rms_norm_quant_torch(x: torch.Tensor, raw: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                             weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm_quant_kernel` by torch ops."""
    s = (x.float() + raw.float() * (row_scale * col_scale.reshape(1, -1))).to(x.dtype)  # [N, H]
    return (s, *quantize_rows(rms_norm(s, weight, eps)))


def add_rms_norm_quant(x: torch.Tensor, raw: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                       weight: torch.Tensor, eps: float,
                       by_kernel: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x + raw * (row_scale * col_scale), that sum normed by `weight` and quantized per row, by the
    kernel (`by_kernel`) or the torch ops -> (sum [N, H], normed float8 [N, H], row scales [N, 1])."""
    fn = add_rms_norm_quant_kernel if by_kernel else add_rms_norm_quant_torch
    return fn(x, raw, row_scale, col_scale.reshape(-1), weight, eps)
