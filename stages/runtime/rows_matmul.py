"""Matmuls for few rows from bf16 weights: `y = x @ W^T (+ b)` with x [M, K], W [N, K], M <= 16.

A decode step multiplies its rows by every weight of the talker, so at few rows its matmuls are
bound by reading the weights, and cuBLAS reads them at 1.8-3.4 TB/s on an H200 at 8 rows
(docs/performance.md): the smaller products (o_proj, down_proj: 2560 output channels) are split
over the inputs and summed in a second kernel, and every launch ramps up and drains around a
read of 5-30 us. This kernel holds every row in one tile (the weights read once), reads
`BLOCK_N` output channels x `BLOCK_K` inputs of W a loop step, and multiplies them on the tensor
cores with fp32 accumulation. When the channels give too few programs to keep the memory busy
the inputs are split `split` ways (a run-time argument: one compiled kernel serves every
split): each split writes fp32 partials, summed by torch (inside a compiled layer half, fused
with what follows).

Measured alone on an H200 (`bench.rows_matmul`), the best tiles of a sweep took 0.81-0.98x
cuBLAS's time at 8 rows, but only 0.88-1.08x at 48, where a step with every matmul in the
kernel's first tiles was 1.24x longer: so `MAX_ROWS` is 16, and `plan` gives one set of tiles,
the sweep's best at 8 rows for the 2560-channel products. `launch` takes any tiles (the sweep). `rows_mm` is a `torch.library.triton_op`:
eager calls launch the kernel and torch.compile traces into it. On the CPU the kernel runs only
under Triton's interpreter (TRITON_INTERPRET=1, the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

MAX_ROWS = 16  # more rows than this go to cuBLAS (as fast or faster from 48 rows on an H200)
TARGET_PROGRAMS = 384  # about three a streaming multiprocessor of an H200 (132)
MIN_SPLIT_K = 256  # inputs a split keeps at least


@triton.jit(do_not_specialize=["M", "split"])  # one kernel for every row count of a tile and every split
def _rows_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, split, stride_xm, stride_wn, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,  # the bias is added by split 0 only
    DOT_FP32: tl.constexpr,  # fp32 operands and products: fp32 rows, and the CPU interpreter (its bf16 tl.dot is wrong)
):
    """Program (n tile, split) -> out[rows, its channels] over its split's inputs."""
    pid_n = tl.program_id(0)
    part = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    per_split = tl.cdiv(tl.cdiv(K, split), BLOCK_K) * BLOCK_K
    k_start = part * per_split
    k_end = tl.minimum(k_start + per_split, K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
        acc += tl.where(part == 0, bias, 0.0)[None, :]
    offs = part * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def plan(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, split, num_warps, num_stages) for x [m, k] @ W [n, k]^T,
    m <= `MAX_ROWS`, from shapes only: every row in one 16-row tile, 64 channels x 64 inputs of
    W a loop step, five stages in flight; the inputs split while the programs stay under
    `TARGET_PROGRAMS` and a split keeps `MIN_SPLIT_K` (at the talker's shapes: 8 ways for 2560
    channels, 4 for 6144, 2 for 7680 and 9728, none for 19456)."""
    if m > MAX_ROWS:  # a comparison: m may be symbolic
        raise ValueError(f"{m} rows: the rows kernel takes at most {MAX_ROWS}")
    tiles = triton.cdiv(n, 64)
    split = 1
    while tiles * split * 2 <= TARGET_PROGRAMS and k // (split * 2) >= MIN_SPLIT_K:
        split *= 2
    return 16, 64, 64, split, 4, 5


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           config: tuple[int, int, int, int, int, int], partials: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) with the launch `config` (as `plan` returns it);
    `partials`: return the fp32 partials [split, M, N] unsummed (the bench times the kernel
    alone)."""
    m, k = x.shape
    n = weight.shape[0]
    block_m, block_n, block_k, split, warps, stages = config
    if m > block_m:
        raise ValueError(f"{m} rows do not fit a {block_m}-row tile")
    exact = x.device.type == "cpu" or x.dtype == torch.float32  # fp32 products in fp32, never TF32
    split_partials = split > 1  # out holds fp32 partials [split, M, N], summed below
    out = (torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split_partials
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    grid = (triton.cdiv(n, block_n), split)
    wrap_triton(_rows_kernel)[grid](
        x, weight, weight if bias is None else bias, out, m, n, k, split, x.stride(0), weight.stride(0),
        n, m * n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        DOT_FP32=exact, num_warps=warps, num_stages=stages)
    if not split_partials or partials:
        return out
    return out.sum(0).to(x.dtype)


@triton_op("mossvox::rows_mm", mutates_args=())
def rows_mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, rows contiguous, M <= `MAX_ROWS`) @ weight [N, K]^T (+ bias
    [N]) -> [M, N] in x's dtype."""
    m, k = x.shape
    return launch(x, weight, bias, plan(m, weight.shape[0], k))
