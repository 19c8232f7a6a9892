"""A layer's residual add and the LayerNorm after it in one kernel (Triton).

Each codec layer ends its two halves with a gained residual add (`x + scale * y`, an `addcmul`)
that the next LayerNorm reads straight back: the sum is written, then read again. In a streaming
chunk both are small kernels (the full v2 decoder runs 92 layers, two such pairs a layer: the
second half's add with the next layer's first LayerNorm), and in a long chunk the 400 Hz stage's
sums are tens of megabytes each. Here one kernel a pair: a program takes a tile of rows, adds,
stores the sum (the residual stream goes on), and normalises the sum as stored (rounded to the
tensor's dtype, which is what a LayerNorm after an `addcmul` reads), in fp32. On CPU it runs in
Triton's interpreter (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn


@triton.jit
def _residual_norm_kernel(
    x_ptr, y_ptr, gain_ptr, w_ptr, b_ptr, sum_ptr, norm_ptr, M, D, eps,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (tile of BLOCK_M rows): sum = x + gain * y; norm = LayerNorm(sum) * w + b."""
    r = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]  # [BLOCK_M, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    col = d < D
    ok = (r < M) & col
    at = r * D + d
    x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + at, mask=ok, other=0.0).to(tl.float32)
    gain = tl.load(gain_ptr + d, mask=col, other=0.0).to(tl.float32)
    total = (x + gain * y).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + at, total, mask=ok)
    s = total.to(tl.float32)  # the sum as stored: what a LayerNorm reading it back would see
    mean = tl.sum(s, axis=1) / D  # [BLOCK_M]
    diff = tl.where(ok, s - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1) / D + eps)
    w = tl.load(w_ptr + d, mask=col, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + d, mask=col, other=0.0).to(tl.float32)
    tl.store(norm_ptr + at, (diff * rstd[:, None] * w + b).to(norm_ptr.dtype.element_ty), mask=ok)


def residual_norm(x: torch.Tensor, y: torch.Tensor, gain: torch.Tensor,
                  norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y [..., D] contiguous, gain [D] -> (x + gain * y, norm(x + gain * y)), both [..., D] in
    x's dtype: `torch.addcmul(x, gain, y)` and the LayerNorm `norm` (with weight and bias) of it."""
    D = x.shape[-1]
    if y.shape != x.shape or not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be contiguous and alike")
    if norm.weight is None or norm.bias is None or tuple(norm.normalized_shape) != (D,):
        raise ValueError("residual_norm needs a LayerNorm over the last dimension with weight and bias")
    total, normed = torch.empty_like(x), torch.empty_like(x)
    M = x.numel() // D
    block_d = max(16, triton.next_power_of_2(D))
    # GPU: a few thousand elements a program; the interpreter runs each program in numpy: few, large
    block_m = 128 if x.device.type == "cpu" else max(1, 4096 // block_d)
    _residual_norm_kernel[(triton.cdiv(M, block_m),)](
        x, y, gain, norm.weight, norm.bias, total, normed, M, D, norm.eps,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4,
    )
    return total, normed
