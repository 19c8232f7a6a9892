"""RoPE and the ring writes of a streaming chunk in one kernel (Triton).

Before attending over its rings in place (`ring_attention`), each layer of a streaming chunk
rotates its queries and keys (interleaved RoPE, fp32 math) and writes the keys and values into
the slots' rings. Done with torch ops that is five kernels a layer (a cast to fp32, the rotation's
arithmetic, the cast back, two `index_copy_`), which at a few rows is five launches of nearly
nothing, and at many rows the fp32 copies' traffic: in a small replay of the full v2 decoder (92
layers) the fixed cost of such launches is most of the replay. Here one kernel a layer: a
program takes a tile of rows of one head, reads their packed q, k, v straight from the input
projection `[B, T, 3, H, Dh]` as whole head rows (coalesced; the pairs are split in registers),
rotates q and k by each row's (cos, sin) table and stores q (contiguous, for the attention
kernel) and k, v at each row's ring row. Values and rows are read
from device tensors, so the kernel runs inside CUDA graphs; on CPU it runs in Triton's
interpreter (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rotate_and_write(x, table, ring, ok, h, k_ptr, v_ptr, stride_xp, stride_kr, stride_kh, stride_vr, stride_vh,
                     d, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows' packed q, k, v of head h at pointers x (q; k `stride_xp` after it, v twice that) and
    their (cos, sin) pairs `table` [BLOCK_R, BLOCK_D]: k rotated and v written at the ring rows
    `ring` [BLOCK_R, 1] (flat slot * capacity + ring index) where `ok` -> q rotated
    [BLOCK_R, BLOCK_D] fp32. Every load and store is a whole head row (contiguous, columns `d`);
    the pairs (2i, 2i+1) are split and joined again in registers."""
    cos, sin = tl.split(tl.reshape(table, (BLOCK_R, BLOCK_D // 2, 2)))  # [BLOCK_R, BLOCK_D / 2] each
    qa, qb = tl.split(tl.reshape(tl.load(x, mask=ok, other=0.0).to(tl.float32), (BLOCK_R, BLOCK_D // 2, 2)))
    ka, kb = tl.split(tl.reshape(tl.load(x + stride_xp, mask=ok, other=0.0).to(tl.float32),
                                 (BLOCK_R, BLOCK_D // 2, 2)))
    v = tl.load(x + 2 * stride_xp, mask=ok, other=0.0)
    k = tl.reshape(tl.join(ka * cos - kb * sin, ka * sin + kb * cos), (BLOCK_R, BLOCK_D))
    tl.store(k_ptr + ring * stride_kr + h * stride_kh + d, k.to(k_ptr.dtype.element_ty), mask=ok)
    tl.store(v_ptr + ring * stride_vr + h * stride_vh + d, v, mask=ok)
    return tl.reshape(tl.join(qa * cos - qb * sin, qa * sin + qb * cos), (BLOCK_R, BLOCK_D))


@triton.jit
def _rope_ring_write_kernel(
    qkv_ptr, table_ptr, rows_ptr, q_ptr, k_ptr, v_ptr, N,
    stride_xr, stride_xp, stride_xh, stride_tr, stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Program (tile of BLOCK_R rows r = b * T + t, head h): rotate q and k of those rows' head h,
    store q, write k and v to the rows' ring rows (`rotate_and_write`)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]  # [BLOCK_R, 1]
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D] element of the head row
    ok = (r < N) & (d < HEAD_DIM)
    table = tl.load(table_ptr + r * stride_tr + d, mask=ok, other=0.0)  # (cos, sin) pairs
    ring = tl.load(rows_ptr + r, mask=r < N, other=0).to(tl.int64)  # slot * capacity + ring index
    q = rotate_and_write(qkv_ptr + r * stride_xr + h * stride_xh + d, table, ring, ok, h, k_ptr, v_ptr,
                         stride_xp, stride_kr, stride_kh, stride_vr, stride_vh, d, BLOCK_R, BLOCK_D)
    tl.store(q_ptr + r * stride_qr + h * stride_qh + d, q.to(q_ptr.dtype.element_ty), mask=ok)


def rope_table(rotor: torch.Tensor) -> torch.Tensor:
    """A plan's rotor [B, T, 1, 1, Dh/2, 2] (cos, sin) -> the kernel's table [B * T, Dh/2, 2] fp32."""
    B, T = rotor.shape[:2]
    return rotor.reshape(B * T, -1, 2).contiguous()


def rope_ring_write(qkv: torch.Tensor, table: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor,
                    rows: torch.Tensor) -> torch.Tensor:
    """qkv [B, T, 3, H, Dh] (the input projection, unrotated), table [B * T, Dh/2, 2] fp32 (`rope_table`),
    rings [S, C, H, Dh], rows [B * T] (slot * C + ring index of each position) -> q [B, T, H, Dh]
    rotated; k rotated and v written into the rings at `rows`. Equals `apply_interleaved_rope` on q
    and k followed by the rings' `index_copy_` of k and v."""
    B, T, three, H, D = qkv.shape
    if three != 3 or D % 2 or qkv.stride(-1) != 1 or k_ring.stride(-1) != 1 or v_ring.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} and the rings need a packed q, k, v with an even, "
                         "contiguous head dimension")
    if qkv.stride(0) != T * qkv.stride(1):
        raise ValueError("qkv's batch and time dimensions must flatten into rows")
    q = torch.empty(B, T, H, D, dtype=qkv.dtype, device=qkv.device)
    k_rows, v_rows = k_ring.view(-1, H, D), v_ring.view(-1, H, D)  # [S * C, H, Dh]
    block_r = 128 if qkv.device.type == "cpu" else 32  # the interpreter runs each program in numpy: few, large
    _rope_ring_write_kernel[(triton.cdiv(B * T, block_r), H)](
        qkv, table, rows, q, k_rows, v_rows, B * T,
        qkv.stride(1), qkv.stride(2), qkv.stride(3), table.stride(0), q.stride(1), q.stride(2),
        k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1),
        HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_R=block_r,
        num_warps=4,  # a program: one head of 32 rows, three 32 x 64 tiles in, three out
    )
    return q
