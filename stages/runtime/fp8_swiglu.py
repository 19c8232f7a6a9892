"""The float8 MLP's SwiGLU product and its quantization in one Triton kernel (`talker.fp8_fused_swiglu`).

With float8 weights multiplied by the w8a8 scheme (`stages.runtime.fp8_linear`), a backbone MLP
runs gate|up's float8 product, its row and channel scales, SiLU(gate) * up, and the per-row
quantization of that product for down's float8 product. Compiled, inductor makes the middle
three one reduction kernel that passes over each row's 9,728 columns twice (the row's largest
magnitude, then the quantized values): on an H200 at 48 rows 6.9-7.1 us a layer, against 1.7
us for the bf16 SiLU product alone; this kernel took 4.4 us there (docs/performance-history.md). Here
one program a row holds the whole row in registers and
reads gate|up's product once: the scales, the SiLU product (fp32), the row's largest magnitude,
then the float8 values and the row's scale. The same arithmetic as the torch ops
(`silu_mul_quant_torch`), except that they round the scaled product to the input dtype before
the SiLU where this keeps fp32 (inductor's compiled kernel keeps fp32 too).

The kernel is a custom op (`torch.library.custom_op`, with its outputs' shapes for tracing), so
a compiled layer half calls it from its own code without a graph break, and the decode graphs
capture its launch. It runs on CUDA, or on the CPU under Triton's interpreter (the tests);
elsewhere `swiglu_fp8` takes the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import custom_op

from stages.runtime.fp8_linear import AMAX_FLOOR, FP8, FP8_MAX, Fp8Linear, quantize_rows


@triton.jit
def _silu_mul_quant_kernel(
    raw_ptr, stride_raw,  # gate|up's float8 product before its scales [M, 2I]
    x_scale_ptr,  # the rows' scales of gate|up's input [M] fp32
    w_scale_ptr,  # gate|up's channel scales [2I] fp32
    out_ptr, stride_out,  # SiLU(gate) * up in float8 [M, I]
    out_scale_ptr,  # its rows' scales [M] fp32
    I, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
):
    """Program m: row m of gate|up, scaled, through SiLU(gate) * up, quantized with one scale."""
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < I
    xs = tl.load(x_scale_ptr + m)
    src = raw_ptr + m * stride_raw
    gate = tl.load(src + cols, mask=keep, other=0.0).to(tl.float32)
    gate = gate * (xs * tl.load(w_scale_ptr + cols, mask=keep, other=0.0))
    up = tl.load(src + I + cols, mask=keep, other=0.0).to(tl.float32)
    up = up * (xs * tl.load(w_scale_ptr + I + cols, mask=keep, other=0.0))
    h = gate * tl.sigmoid(gate) * up  # [BLOCK] fp32, zero past I
    scale = tl.maximum(tl.max(tl.abs(h), 0), TINY) / FP8_MAX
    q = tl.minimum(tl.maximum(h / scale, -FP8_MAX), FP8_MAX)
    tl.store(out_ptr + m * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=keep)
    tl.store(out_scale_ptr + m, scale)


def _warps(block: int) -> int:
    """Warps for a row of `block` columns: 16 of each fp32 row vector a thread (512 columns a
    warp), so the row stays in registers."""
    return max(1, min(32, block // 512))


@custom_op("mossvox::fp8_silu_mul_quant", mutates_args=())
def silu_mul_quant(raw: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """raw [M, 2I] (gate|up's float8 product before its scales), x_scale [M, 1] fp32 (its input
    rows' scales), w_scale [2I] fp32 (its channels') -> (h_fp8 [M, I], h_scale [M, 1] fp32) with
    h_fp8 * h_scale ≈ SiLU(gate) * up, one kernel launch (CUDA, or Triton's interpreter)."""
    m, two_i = raw.shape
    out = torch.empty((m, two_i // 2), dtype=FP8, device=raw.device)
    out_scale = torch.empty((m, 1), dtype=torch.float32, device=raw.device)
    launch_silu_mul_quant(raw, x_scale, w_scale, out, out_scale)
    return out, out_scale


def launch_silu_mul_quant(raw: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
                          out_scale: torch.Tensor, num_warps: int | None = None) -> None:
    """`silu_mul_quant` into out [M, I] (float8) and out_scale [M, 1]; `num_warps`: a program's
    warps (None: 512 columns a warp; `bench.kernels.fp8_kernels` times others)."""
    m, i = out.shape
    if m == 0:
        return
    block = triton.next_power_of_2(i)
    _silu_mul_quant_kernel[(m,)](raw, raw.stride(0), x_scale, w_scale, out, out.stride(0), out_scale, i,
                                 BLOCK=block, FP8_MAX=FP8_MAX, TINY=AMAX_FLOOR, num_warps=num_warps or _warps(block))


@silu_mul_quant.register_fake
def _(raw: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs' shapes for tracing (torch.compile)."""
    m, two_i = raw.shape
    return raw.new_empty((m, two_i // 2), dtype=FP8), raw.new_empty((m, 1), dtype=torch.float32)


def silu_mul_quant_torch(raw: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul_quant` by torch ops, the scaled product rounded to `dtype` as `Fp8Linear` returns it."""
    gate, up = (raw.float() * (x_scale * w_scale)).to(dtype).chunk(2, dim=-1)  # [M, I] each
    return quantize_rows(torch.nn.functional.silu(gate) * up)


def quantized_swiglu(gate_up: Fp8Linear, x: torch.Tensor, by_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(gate) * up of x [M, H] through a w8a8 float8 gate|up without bias, quantized per row
    for down by the kernel (`by_kernel`) or the torch ops -> (h_fp8 [M, I], h_scale [M, 1])."""
    x_fp8, x_scale = quantize_rows(x)
    return quantized_swiglu_from(gate_up, x_fp8, x_scale, x.dtype, by_kernel)


def quantized_swiglu_from(gate_up: Fp8Linear, x_fp8: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype,
                          by_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantized_swiglu` from inputs already quantized per row: x_fp8 [M, H], x_scale [M, 1]
    (the torch ops round gate|up's scaled product to `dtype`) -> (h_fp8 [M, I], h_scale [M, 1])."""
    raw = gate_up.raw_product(x_fp8)  # [M, 2I]
    w_scale = gate_up.weight_scale.view(-1)  # [2I]
    if by_kernel:
        return silu_mul_quant(raw, x_scale, w_scale)
    return silu_mul_quant_torch(raw, x_scale, w_scale, dtype)


def swiglu_fp8(gate_up: Fp8Linear, down: Fp8Linear, x: torch.Tensor, by_kernel: bool) -> torch.Tensor:
    """down(SiLU(gate) * up) of x [..., H] through w8a8 float8 layers without biases
    (`quantized_swiglu`, then down's product from those float8 rows) -> [..., H] in x's dtype."""
    lead = x.shape[:-1]
    h, h_scale = quantized_swiglu(gate_up, x.reshape(-1, gate_up.in_features), by_kernel)
    return down.from_quantized(h, h_scale, x.dtype).reshape(*lead, down.out_features)
