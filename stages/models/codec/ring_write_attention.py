"""RoPE, the ring writes and the ring attention of a streaming chunk's layer in one kernel (Triton).

With the fused ring writes a streaming layer's attention is two launches: `rope_ring_write`
(rotate q and k, write k and v into the slots' rings) and `ring_attention` (read them back in
place). In a short replay of the full v2 decoder (92 layers, a few microseconds of work each)
every launch is mostly fixed cost. Here one launch a layer: a program owns (row b, head h) of
the chunk, first rotates and writes every position of its chunk for that head (`rotate_and_write`,
keeping q in the output buffer), then, after a barrier among its own threads, attends each tile
of those queries over the ring (`attend_tile`). Only this program reads what it wrote: the keys a
query sees are of its own slot and head, and the ring rows the chunk overwrites hold positions
older than any query of the chunk can see (the ring's capacity is at least the context plus the
chunk), so no other program's writes are awaited. The ring and q loads after the barrier bypass
L1 (`.cg`), reading what the program's threads stored.

A chunk cut into rows of its slot (`StreamingDecoder.decode(offset=...)`: a later piece's queries
see the earlier pieces' keys) is one program's work: the program of its first piece (the row of
that slot with the earliest start in the call) does the pieces one after another in order of
start, and the other pieces' programs return at once. Padding rows share the scratch slot at one
start: each does its own row, as in the two kernels (their keys are garbage either way).

Fewer programs than the two kernels' (one a row and head, not one a query tile): a long chunk's
query tiles run one after another in its program, which at the served row counts (tens of rows,
several heads) still fills the GPU. Slots and positions come from device tensors, so it runs
inside CUDA graphs; on CPU Triton's interpreter runs it (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stages.models.codec.ring_attention import attend_tile
from stages.models.codec.ring_write import rotate_and_write


@triton.jit
def _write_attend_row(b, h, slot, start, qkv_ptr, table_ptr, out_ptr, k_ptr, v_ptr, qk_scale, T, C, context,
                      stride_xb, stride_xt, stride_xp, stride_xh, stride_tr, stride_ob, stride_ot, stride_oh,
                      stride_ks, stride_kc, stride_kh, stride_vs, stride_vc, stride_vh,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """Row b's T positions of head h (the first at `start`, in ring `slot`): rotated and written,
    then, after a barrier, attended (q kept in the output buffer between the two)."""
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    for t0 in range(0, T, BLOCK_M):
        t = t0 + tl.arange(0, BLOCK_M)[:, None]  # [BLOCK_M, 1]
        ok = (t < T) & (d < HEAD_DIM)
        table = tl.load(table_ptr + (b * T + t).to(tl.int64) * stride_tr + d, mask=ok, other=0.0)
        ring = slot * C + (start + t) % C  # [BLOCK_M, 1] flat ring rows
        q = rotate_and_write(qkv_ptr + b * stride_xb + t * stride_xt + h * stride_xh + d, table, ring, ok, h,
                             k_ptr, v_ptr, stride_xp, stride_kc, stride_kh, stride_vc, stride_vh, d, BLOCK_M, BLOCK_D)
        tl.store(out_ptr + b * stride_ob + t * stride_ot + h * stride_oh + d, q.to(out_ptr.dtype.element_ty), mask=ok)
    tl.debug_barrier()  # every write above is visible to this program's threads below
    for t0 in range(0, T, BLOCK_M):
        j = t0 + tl.arange(0, BLOCK_M)
        ok = (j[:, None] < T) & (d < HEAD_DIM)
        o_ptr = out_ptr + b * stride_ob + j[:, None] * stride_ot + h * stride_oh + d
        q = tl.load(o_ptr, mask=ok, other=0.0, cache_modifier=".cg")
        if DOT_FP32:
            q = q.to(tl.float32)
        q_first = start + t0
        q_last = tl.minimum(q_first + BLOCK_M - 1, start + T - 1)  # the tile's last real query
        o = attend_tile(q, start + j, q_first, q_last, slot, h, k_ptr, v_ptr, qk_scale, C, context,
                        stride_ks, stride_kc, stride_kh, stride_vs, stride_vc, stride_vh,
                        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, DOT_PRECISION, ".cg")
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=ok)
    tl.debug_barrier()  # the next row of the slot writes only after this one has read


@triton.jit
def _rope_write_attend_kernel(
    qkv_ptr, table_ptr, slots_ptr, start_ptr, out_ptr, k_ptr, v_ptr,
    qk_scale,  # softmax scale * log2(e)
    B, T, C, context,
    stride_xb, stride_xt, stride_xp, stride_xh, stride_tr, stride_ob, stride_ot, stride_oh,
    stride_ks, stride_kc, stride_kh, stride_vs, stride_vc, stride_vh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (row b, head h). A row whose slot has a row of an earlier start in this call is a
    later piece of a cut chunk and leaves its work to that one; the first piece's program does
    its slot's rows one after another in order of start (`_write_attend_row`)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    start = tl.load(start_ptr + b).to(tl.int64)  # absolute position of the row's first query
    rows = tl.arange(0, BLOCK_B)
    all_slots = tl.load(slots_ptr + rows, mask=rows < B, other=-1).to(tl.int64)
    all_starts = tl.load(start_ptr + rows, mask=rows < B, other=0).to(tl.int64)
    same = all_slots == slot
    if tl.sum((same & (all_starts < start)).to(tl.int32), 0) == 0:  # the slot's first row here
        row = b
        cur = start
        more = 1
        while more > 0:
            _write_attend_row(row, h, slot, cur, qkv_ptr, table_ptr, out_ptr, k_ptr, v_ptr, qk_scale, T, C, context,
                              stride_xb, stride_xt, stride_xp, stride_xh, stride_tr, stride_ob, stride_ot, stride_oh,
                              stride_ks, stride_kc, stride_kh, stride_vs, stride_vc, stride_vh,
                              HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, DOT_PRECISION, DOT_FP32)
            later = same & (all_starts > cur)
            more = tl.sum(later.to(tl.int32), 0)
            nxt = tl.min(tl.where(later, all_starts, cur + C), 0)  # the next piece's start
            row = tl.min(tl.where(later & (all_starts == nxt), rows, BLOCK_B), 0)
            cur = nxt


def rope_write_attend(qkv: torch.Tensor, table: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor,
                      slots: torch.Tensor, start: torch.Tensor, context: int, *, block_m: int = 64,
                      block_n: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """qkv [B, T, 3, H, Dh] (the input projection, unrotated), table [B * T, Dh/2, 2] fp32
    (`ring_write.rope_table`), rings [S, C, H, Dh] (contiguous slots), the rows' slots [B] and
    first positions start [B] (rows of one slot: a cut chunk's pieces, module docstring) -> out
    [B, T, H, Dh]; k rotated and v written into the rings at each position's ring row (slot * C +
    position mod C). Equals `rope_ring_write` followed by `ring_attention` (tiles as there:
    `block_m` queries x `block_n` keys, 64 x 64 on CUDA, 64 x 256 on CPU)."""
    B, T, three, H, D = qkv.shape
    S, C = k_ring.shape[:2]
    if three != 3 or D % 2 or qkv.stride(-1) != 1 or k_ring.stride(-1) != 1 or v_ring.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} and the rings need a packed q, k, v with an even, "
                         "contiguous head dimension")
    if k_ring.stride(0) != C * k_ring.stride(1) or v_ring.stride(0) != C * v_ring.stride(1):
        raise ValueError("the rings' slots must be contiguous runs of their C rows")
    cpu = qkv.device.type == "cpu"
    block_n = block_n or (256 if cpu else 64)
    block_m = min(block_m, max(16, triton.next_power_of_2(T)))
    out = torch.empty(B, T, H, D, dtype=qkv.dtype, device=qkv.device)
    _rope_write_attend_kernel[(B, H)](
        qkv, table, slots, start, out, k_ring, v_ring,
        D ** -0.5 * 1.4426950408889634, B, T, C, context,
        qkv.stride(0), qkv.stride(1), qkv.stride(2), qkv.stride(3), table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        k_ring.stride(0), k_ring.stride(1), k_ring.stride(2), v_ring.stride(0), v_ring.stride(1), v_ring.stride(2),
        HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_B=max(16, triton.next_power_of_2(B)), DOT_PRECISION="ieee" if qkv.dtype == torch.float32 else None, DOT_FP32=cpu,
        num_warps=num_warps, **({} if cpu else {"num_stages": 2}),
    )
    return out
