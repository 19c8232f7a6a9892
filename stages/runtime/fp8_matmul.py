"""Matmuls from float8 weights for few rows: `y = x @ (W_fp8 * scale)^T`, x in bf16 or fp32.

The talker's decode step multiplies a few dozen rows by every weight of the backbone: the time
is the weights' bytes, so float8 weights could take half of it. cuBLAS multiplies float8 by
float8 only (`torch._scaled_mm`, the w8a8 path of `stages.runtime.fp8_linear`); this kernel
keeps the rows as they are and reads the weights in tiles of
`BLOCK_N` output channels x `BLOCK_K` inputs, upcasts them to x's dtype in registers (every e4m3
value is exact in bf16) and multiplies them with the rows' tile of x on the tensor cores, fp32
accumulation; the scale per output channel is applied once at the end. x is not quantized
("W8A16"): the only rounding added to bf16's is the weights' own.

When the output channels give too few programs to load the memory (o_proj and down_proj of the
4B backbone: 2560 channels, 20 tiles of 128), the inputs are split `SPLIT_K` ways: each program
writes an fp32 partial product and the partials are summed by torch (inside a compiled layer
half, fused with what follows). Every launch parameter follows from shapes only (rows, channels,
inputs), so a decode step's graph replays the same launch.

The kernel is a `torch.library.triton_op`: eager calls launch it, and torch.compile traces
into it (the split sum fused by inductor). On the CPU it runs under Triton's interpreter only
(TRITON_INTERPRET=1, the tests); `Fp8Linear` computes the same products with torch there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

TARGET_PROGRAMS = 264  # two a streaming multiprocessor of an H200 (132)
MIN_SPLIT_K = 512  # inputs a split keeps at least


@triton.jit(do_not_specialize=["M"])  # one kernel for every row count of a bucket's tile
def _fp8_weight_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # >1: out is fp32 partials [SPLIT_K, M, N], summed by the caller
    DOT_FP32: tl.constexpr,  # fp32 operands and products: fp32 rows, and the CPU interpreter (its bf16 tl.dot is wrong)
):
    """Program (n tile, m tile, split) -> out[rows, channels] of its split's inputs."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = split * per_split
    k_end = tl.minimum(k_start + per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N] float8
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    scale = tl.load(scale_ptr + rn, mask=n_ok, other=0.0)  # [BLOCK_N] fp32
    acc = acc * scale[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    offs = split * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def plan(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for x [m, k] @ W [n, k]^T,
    from shapes only: every row in one tile up to 128 rows (the weights read once) and the
    inputs split while the programs stay under `TARGET_PROGRAMS` and a split keeps `MIN_SPLIT_K`
    inputs. Every channel tile reads all of x's rows again (from L2): at 88 rows a 64-channel
    tile of float8 weights comes with ~2.75 bytes of x a weight byte, a 128-channel tile with
    half that, so past 16 rows the tiles are 128 channels wide (fewer programs, made up by
    splits); at 16 rows or fewer x is small and 64 channels give more programs. More rows than a
    tile (a prefill's) is a compute-bound product: 128 x 128 tiles, as a GEMM's."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128  # comparisons: m may be symbolic
    if m > 128:
        return 128, 128, 64, 1, 8, 3
    block_n = 64 if block_m == 16 else 128
    block_k = 128 if block_m <= 64 else 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    while tiles * split * 2 <= TARGET_PROGRAMS and k // (split * 2) >= MIN_SPLIT_K:
        split *= 2
    return block_m, block_n, block_k, split, 4 if block_m <= 32 else 8, 4 if block_m <= 64 else 3


def launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           config: tuple[int, int, int, int, int, int]) -> torch.Tensor:
    """`w8a16_mm` with the launch `config` given (as `plan` returns it): the bench's tile sweep."""
    m, k = x.shape
    n = weight.shape[0]
    out_dtype = x.dtype
    block_m, block_n, block_k, split, warps, stages = config
    # fp32 products in fp32 (not TF32) on CUDA too; on the CPU the interpreter needs them
    exact = x.device.type == "cpu" or x.dtype == torch.float32
    if split == 1:
        out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    wrap_triton(_fp8_weight_kernel)[grid](
        x, weight, scale, out, m, n, k, x.stride(0),
        weight.stride(0), n, m * n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, DOT_FP32=exact, num_warps=warps,
        num_stages=stages)
    if split == 1:
        return out
    return out.sum(0).to(out_dtype)


@triton_op("mossvox::w8a16_mm", mutates_args=())
def w8a16_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, rows contiguous) @ (weight [N, K] float8 e4m3 * scale [N] fp32)^T
    -> [M, N] in x's dtype."""
    m, k = x.shape
    return launch(x, weight, scale, plan(m, weight.shape[0], k))

