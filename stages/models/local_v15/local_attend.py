"""A local position's attention in one Triton kernel (`talker.local_attention: kernel`).

A frame's local loop runs the one-layer local block at positions 0..11 one after another; at
position p one query attends over the keys of positions 0..p. With `plain` attention the
compiled loop does that as four small kernels a position (the RoPE rotations of q and k with
the products and their sums, the softmax in two, the weighted sum of values: on an H200 at 48
rows 9.2 us of the ~98 us of kernels a position, docs/performance-history.md). Here one kernel does it all
from the input projection's outputs as the matmul left them: `qkv[j]` [B, 3 * H] (q | k | v,
head-major, bias added) of each position j <= p so far. A program owns (row b, `HEADS` heads):
it rotates position p's query, and each position j's key at j (GPT-J interleaved pairs, fp32,
rounded to the tensors' dtype as the torch rotation leaves it), keeps the p + 1 scores in
registers, softmax in fp32, and sums the values weighted -> out [B, H]. Keys are rotated again
at every later position (a few hundred multiplies) instead of being stored, so the frame keeps
only the matmul outputs and nothing is written into a buffer that torch.compile would copy.
The angles are computed here too (as tables, the compiled loop made them again at every
position: two launches). Measured on an H200: ~5 us a position at 48 rows alone with two heads
a program (its first build, the angles from tables), the step alone level with `plain` (the
first build, eight heads a program), and this build served at C=64 1.01x (inside the spread); off.

It is a `torch.library.triton_op`: eager calls launch the kernel, and the compiled local loop
traces into it. The positions come as separate pointer arguments (at most `MAX_POSITIONS`),
chosen at compile time: each position's call is its own specialisation. On CPU it runs in
Triton's interpreter only (the tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

MAX_POSITIONS = 16  # the local block's positions a frame (Local-v1.5: 12)


@triton.jit
def _position(j: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15):
    """Position j's pointer among the arguments (j known at compile time)."""
    ptr = p0
    if j == 1:
        ptr = p1
    if j == 2:
        ptr = p2
    if j == 3:
        ptr = p3
    if j == 4:
        ptr = p4
    if j == 5:
        ptr = p5
    if j == 6:
        ptr = p6
    if j == 7:
        ptr = p7
    if j == 8:
        ptr = p8
    if j == 9:
        ptr = p9
    if j == 10:
        ptr = p10
    if j == 11:
        ptr = p11
    if j == 12:
        ptr = p12
    if j == 13:
        ptr = p13
    if j == 14:
        ptr = p14
    if j == 15:
        ptr = p15
    return ptr


@triton.jit
def _rotated(src, j: tl.constexpr, inv_freq, offs, ok):
    """The pairs (2i, 2i+1) at `src + offs` ([HEADS, BLOCK_PAIRS] offsets of each pair's first
    element, `ok` its mask) rotated by position j's angles (`inv_freq` [BLOCK_PAIRS] fp32; cos
    and sin rounded to src's dtype, as the torch tables are) -> (even, odd) fp32, rounded to
    src's dtype (the torch rotation's output dtype)."""
    x1 = tl.load(src + offs, mask=ok, other=0.0)
    x2 = tl.load(src + offs + 1, mask=ok, other=0.0)
    angle = inv_freq * j
    c = tl.cos(angle).to(x1.dtype).to(tl.float32)[None, :]
    s = tl.sin(angle).to(x1.dtype).to(tl.float32)[None, :]
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    even = (a1 * c - a2 * s).to(x1.dtype).to(tl.float32)
    odd = (a2 * c + a1 * s).to(x1.dtype).to(tl.float32)
    return even, odd


@triton.jit
def _local_attend_kernel(
    out_ptr, log2_base,
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,  # qkv of positions 0..P-1
    stride_row, stride_out, scale,
    P: tl.constexpr,  # positions so far: the query is position P - 1's
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Program (row b, heads g * HEADS ..) -> out[b, those heads]."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    hidden: tl.constexpr = NUM_HEADS * HEAD_DIM
    heads = g * HEADS + tl.arange(0, HEADS)
    pairs = tl.arange(0, BLOCK_PAIRS)
    ok = (heads < NUM_HEADS)[:, None] & (pairs < HEAD_DIM // 2)[None, :]
    inv_freq = tl.exp2(-(2 * pairs).to(tl.float32) / HEAD_DIM * log2_base)  # base ** (-2i / D)
    offs = b * stride_row + heads[:, None] * HEAD_DIM + 2 * pairs[None, :]  # [HEADS, BLOCK_PAIRS]
    last = _position(P - 1, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15)
    q1, q2 = _rotated(last, P - 1, inv_freq, offs, ok)
    cols = tl.arange(0, BLOCK_P)
    scores = tl.full([HEADS, BLOCK_P], float("-inf"), tl.float32)
    for j in tl.static_range(P):
        src = _position(j, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15)
        k1, k2 = _rotated(src + hidden, j, inv_freq, offs, ok)
        s = tl.sum(q1 * k1 + q2 * k2, 1) * scale  # [HEADS]
        scores = tl.where(cols[None, :] == j, s[:, None], scores)
    top = tl.max(scores, 1)
    e = tl.exp(scores - top[:, None])  # the columns past P - 1: exp(-inf) = 0
    weights = e / tl.sum(e, 1)[:, None]
    acc1 = tl.zeros([HEADS, BLOCK_PAIRS], tl.float32)
    acc2 = tl.zeros([HEADS, BLOCK_PAIRS], tl.float32)
    for j in tl.static_range(P):
        src = _position(j, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15) + 2 * hidden
        w = tl.sum(tl.where(cols[None, :] == j, weights, 0.0), 1)[:, None]  # [HEADS, 1]
        acc1 += w * tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
        acc2 += w * tl.load(src + offs + 1, mask=ok, other=0.0).to(tl.float32)
    dst = out_ptr + b * stride_out + heads[:, None] * HEAD_DIM + 2 * pairs[None, :]
    tl.store(dst, acc1.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + 1, acc2.to(out_ptr.dtype.element_ty), mask=ok)


@triton_op("mossvox::local_attend", mutates_args=())
def local_attend(qkv: list[torch.Tensor], num_heads: int, rope_base: float,
                 heads_per_program: int = 2) -> torch.Tensor:
    """The attention of position P - 1's query over positions 0..P-1 (P = len(qkv)): qkv[j] [B,
    3 * H] the input projection's output at local position j (q | k | v, each head-major, before
    RoPE at base `rope_base`, GPT-J pairs) -> [B, H] in qkv's dtype, the heads' outputs side by
    side. Equals `LocalAttention.step` with plain attention up to float rounding (the angles'
    own: computed here in fp32, cos and sin rounded to qkv's dtype as the torch tables are).
    `heads_per_program`: 2 is the fastest on an H200 at 48 and 88 rows (`python -m
    bench.kernels.local_attend`)."""
    first = qkv[0]
    B, width = first.shape
    hidden = width // 3
    head_dim = hidden // num_heads
    P = len(qkv)
    if not 1 <= P <= MAX_POSITIONS or width != 3 * hidden or hidden != num_heads * head_dim or head_dim % 2:
        raise ValueError(f"{P} positions of {tuple(first.shape)} for {num_heads} heads: need 1..{MAX_POSITIONS} "
                         "positions of [B, 3 * heads * even head_dim]")
    if any(t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype for t in qkv) \
            or first.stride(1) != 1:
        raise ValueError("the positions' projections need one shape, dtype and row stride, contiguous rows")
    out = torch.empty(B, hidden, dtype=first.dtype, device=first.device)
    heads = min(heads_per_program, triton.next_power_of_2(num_heads))
    pointers = list(qkv) + [first] * (MAX_POSITIONS - P)
    wrap_triton(_local_attend_kernel)[(B, triton.cdiv(num_heads, heads))](
        out, math.log2(rope_base), *pointers, first.stride(0), out.stride(0), head_dim ** -0.5,
        P=P, NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS=heads,
        BLOCK_PAIRS=triton.next_power_of_2(head_dim // 2), BLOCK_P=max(16, triton.next_power_of_2(P)),
    )
    return out
