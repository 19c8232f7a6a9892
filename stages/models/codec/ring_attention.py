"""Windowed attention of a streaming chunk straight over its slots' ring caches (Triton).

The plain path (`CausalWindowAttention.attend`) copies each row's whole ring out of the slot pool
(`index_select`, ~125 MB a slot for the full v2 decoder in bf16, read and written) and hands
SDPA an additive mask `[B, 1, T, C]` built per stage. Here one kernel reads the keys and values in
place: a program owns (a tile of `BLOCK_M` queries, row b, head h) and walks only the key
positions its queries can see, from `max(0, first query - context + 1)` to its last query, in
tiles of `BLOCK_N`, each position read at ring index `position mod C` (the ring holds the last C
positions, and C >= context + chunk length, so every one of them is there); the window rule
`0 <= query - key < context` masks the rest in registers. A tile of queries so reads at most
`context + BLOCK_M` keys, not the whole ring (880 ring rows against a 400-key window in the full
v2 decoder's last stage). Softmax online in fp32 (exp2, scale folded in).

Launch shapes depend only on tensor shapes (B, T, heads, head dim); slots and positions are read
from device tensors, so the kernel runs inside CUDA graphs. On CPU it runs in Triton's
interpreter (`TRITON_INTERPRET=1` set before triton is imported), which the tests use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def attend_tile(q, q_pos, q_first, q_last, slot, h, k_ptr, v_ptr, qk_scale, C, context,
                stride_ks, stride_kc, stride_kh, stride_vs, stride_vc, stride_vh,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_PRECISION: tl.constexpr, CACHE: tl.constexpr):
    """One tile of queries q [BLOCK_M, BLOCK_D] at positions q_pos [BLOCK_M] (the tile's first
    q_first, its last real one q_last) of ring `slot`, head h, over the keys they can see ->
    out [BLOCK_M, BLOCK_D] fp32. `CACHE`: the ring loads' cache modifier ("" or ".cg": past L1,
    for rings this program wrote itself)."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    k_first = tl.maximum(q_first - context + 1, 0)  # the oldest key a query of the tile can see
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for p0 in range(k_first, q_last + 1, BLOCK_N):
        pos_k = p0 + tl.arange(0, BLOCK_N)  # key positions
        k_ok = pos_k <= q_last
        n = pos_k % C  # their ring indices
        k_t = tl.load(k_ptr + slot * stride_ks + n[None, :] * stride_kc + h * stride_kh + d[:, None],
                      mask=k_ok[None, :] & d_ok[:, None], other=0.0, cache_modifier=CACHE)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2
        delta = q_pos[:, None] - pos_k[None, :]
        allowed = k_ok[None, :] & (delta >= 0) & (delta < context)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot * stride_vs + n[:, None] * stride_vc + h * stride_vh + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=CACHE)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]


@triton.jit
def _ring_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, slots_ptr, start_ptr,
    qk_scale,  # softmax scale * log2(e)
    T, C, context,
    stride_qb, stride_qt, stride_qh, stride_ks, stride_kc, stride_kh, stride_vs, stride_vc, stride_vh,
    stride_ob, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else None
    DOT_FP32: tl.constexpr,  # upcast dot operands (the CPU interpreter's bf16 dot is wrong)
):
    """Program (query tile, row b, head h) -> out[b, tile rows, h]."""
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    start = tl.load(start_ptr + b).to(tl.int64)  # absolute position of the chunk's first query
    j = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = j < T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + j[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_first = start + tile * BLOCK_M
    q_last = tl.minimum(q_first + BLOCK_M - 1, start + T - 1)  # the tile's last real query
    o = attend_tile(q, start + j, q_first, q_last, slot, h, k_ptr, v_ptr, qk_scale, C, context,
                    stride_ks, stride_kc, stride_kh, stride_vs, stride_vc, stride_vh,
                    HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, DOT_PRECISION, "")
    tl.store(out_ptr + b * stride_ob + j[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def ring_attention(q: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor, slots: torch.Tensor,
                   start: torch.Tensor, context: int, *, block_m: int | None = None, block_n: int | None = None,
                   num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """q [B, T, H, Dh] (RoPE applied) of the chunk whose first position is start [B] in slots [B];
    k_ring, v_ring [S, C, H, Dh], the chunk's keys already written -> out [B, T, H, Dh].
    Tiles: `block_m` queries x `block_n` keys (default 64 x 64, 4 warps, 2 stages: on an H200 the
    fastest or within 3% of it at 1, 4, 8 and 15 frames for 128 rows of the full v2 decoder; on
    CPU, where the interpreter runs each program in numpy, 64 x 256: fewer, larger steps);
    `num_warps`, `num_stages` (None: 2 on CUDA) as for any Triton launch (`python -m
    bench.kernels.codec_ring` times configurations)."""
    cpu = q.device.type == "cpu"
    block_m = block_m or 64
    block_n = block_n or (256 if cpu else 64)
    num_stages = num_stages if num_stages is not None or cpu else 2
    B, T, H, D = q.shape
    C = k_ring.shape[1]
    if q.stride(-1) != 1 or k_ring.stride(-1) != 1 or v_ring.stride(-1) != 1:
        raise ValueError("q and the rings need a contiguous last (head_dim) dimension")
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    block_m = min(block_m, max(16, _pow2(T)))
    grid = (triton.cdiv(T, block_m), B, H)
    _ring_attention_kernel[grid](
        q, k_ring, v_ring, out, slots, start,
        D ** -0.5 * 1.4426950408889634, T, C, context,
        q.stride(0), q.stride(1), q.stride(2), k_ring.stride(0), k_ring.stride(1), k_ring.stride(2),
        v_ring.stride(0), v_ring.stride(1), v_ring.stride(2), out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=D, BLOCK_D=max(16, _pow2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        DOT_FP32=q.device.type == "cpu", num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return out
