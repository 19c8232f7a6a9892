"""A backbone layer's q/k norms, RoPE and KV stores in one Triton kernel (`talker.fused_qk_rope_store`).

Between a layer's q/k/v projection and its attention the compiled layer half runs the q and k
RMSNorms and the RoPE rotation (one or two kernels), and the paged cache then takes the new keys
and values by two `index_copy` launches: at 88 decode rows on an H200 those are 72 launches and
0.21 ms of a 7.2 ms step, and every launch also costs ~1.2 us of idle GPU between kernels. Here
one program a (token, head) does all of it in registers: the head's RMSNorm (fp32 statistics,
the normalised value rounded to the input dtype before the weight multiplies it, as
`rms_norm`), the NeoX rotation in fp32, and for a KV head the stores of the rotated key and the
value at the token's flat slot (`slot_mapping`: block = slot // block_size). The query comes
back rotated; the cache is written in place (a float8 cache saturated at its largest finite
value, as `to_cache_dtype`). Rounding differs from the torch ops only where they round an
intermediate to the input dtype (the rotation's products). With float8 projections whose
scales are left to it (`talker.fp8_fused_scales`), it multiplies each loaded value by its
row's and channel's scale first.

The kernel runs eagerly (and inside a CUDA graph capture); it is not traced by torch.compile,
which would functionalize the in-place stores into the pools. Without CUDA it runs only under
Triton's interpreter (the tests); elsewhere the model takes the torch ops
(`Qwen3Model.store_kv_by_kernel`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stages.runtime.kv_cache import FLOAT8_TYPES


@triton.jit(do_not_specialize=["stride_slot"])  # 1 eagerly, a decode graph's packed width there: one kernel
def _qk_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, stride_q, stride_k, stride_v,  # this step's projections [N, heads * D]
    q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin,  # norms [D]; tables [N, D]
    slot_ptr, stride_slot, keys_ptr, values_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    out_ptr, stride_on, stride_oh, eps,
    row_scale_ptr, col_scale_ptr,  # SCALED: a float8 product's scales, rows [N] and channels [(HQ + 2 HKV) D]
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SATURATE: tl.constexpr,  # a float8 cache's largest finite value, else 0.0
    SCALED: tl.constexpr,  # q/k/v are a float8 product before its scales, applied here as they load
):
    """Program (token t, head h): h < HQ rotates query head h into out; else KV head h - HQ:
    its key normed and rotated, and its value, stored at the token's slot."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    lo = tl.arange(0, D // 2)
    is_q = h < HQ
    kv = h - HQ
    if is_q:
        src = q_ptr + t * stride_q + h * D
        weight_ptr = q_weight_ptr
        channel = h * D  # the head's first column of q|k|v
    else:
        src = k_ptr + t * stride_k + kv * D
        weight_ptr = k_weight_ptr
        channel = (HQ + kv) * D
    x1 = tl.load(src + lo)  # [D/2] first half, in the projections' dtype
    x2 = tl.load(src + D // 2 + lo)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    if SCALED:
        row_scale = tl.load(row_scale_ptr + t)
        a1 = a1 * (row_scale * tl.load(col_scale_ptr + channel + lo))
        a2 = a2 * (row_scale * tl.load(col_scale_ptr + channel + D // 2 + lo))
    inv = tl.rsqrt((tl.sum(a1 * a1, 0) + tl.sum(a2 * a2, 0)) / D + eps)
    # as rms_norm: the normalised value in x's dtype, then the weight
    n1 = (a1 * inv).to(x1.dtype).to(tl.float32) * tl.load(weight_ptr + lo).to(tl.float32)
    n2 = (a2 * inv).to(x1.dtype).to(tl.float32) * tl.load(weight_ptr + D // 2 + lo).to(tl.float32)
    cos1 = tl.load(cos_ptr + t * stride_cos + lo).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * stride_cos + D // 2 + lo).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * stride_sin + lo).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * stride_sin + D // 2 + lo).to(tl.float32)
    r1 = n1 * cos1 - n2 * sin1  # NeoX: rotate_half(x) = (-x2, x1)
    r2 = n2 * cos2 + n1 * sin2
    if is_q:
        dst = out_ptr + t * stride_on + h * stride_oh
        tl.store(dst + lo, r1.to(out_ptr.dtype.element_ty))
        tl.store(dst + D // 2 + lo, r2.to(out_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr + t * stride_slot)
        block, row = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        kdst = keys_ptr + block * stride_kb + row * stride_ks + kv * stride_kh
        vdst = values_ptr + block * stride_vb + row * stride_vs + kv * stride_vh
        d = tl.arange(0, D)
        v = tl.load(v_ptr + t * stride_v + kv * D + d).to(tl.float32)
        if SCALED:
            v = v * (row_scale * tl.load(col_scale_ptr + (HQ + HKV + kv) * D + d))
        if SATURATE > 0:  # a float8 cache: its largest finite value, not the cast's NaN
            r1 = tl.minimum(tl.maximum(r1, -SATURATE), SATURATE)
            r2 = tl.minimum(tl.maximum(r2, -SATURATE), SATURATE)
            v = tl.minimum(tl.maximum(v, -SATURATE), SATURATE)
        tl.store(kdst + lo, r1.to(keys_ptr.dtype.element_ty))
        tl.store(kdst + D // 2 + lo, r2.to(keys_ptr.dtype.element_ty))
        tl.store(vdst + d, v.to(values_ptr.dtype.element_ty))


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor,
                       row_scale: torch.Tensor | None = None, col_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq * D], k, v [N, Hkv * D] (a layer's projections; rows may be strided views of one
    fused matmul's output), the q/k norms' weights [D] and `eps`, RoPE tables cos, sin [N, D];
    stores the normed, rotated keys and the values in one layer's paged cache `keys`, `values`
    [blocks, block_size, Hkv, D] at flat slots `slot_mapping [N]` and returns the normed,
    rotated queries [N, Hq, D] (q's dtype). With `row_scale [N, 1]` and `col_scale`
    [(Hq + 2 Hkv) * D] (fp32), q/k/v are a float8 q|k|v product before its scales, each value
    multiplied by its row's and channel's as it loads (`Fp8Linear.product`). One kernel launch
    (CUDA, or Triton's interpreter)."""
    n, d = cos.shape
    hq, hkv = q.shape[-1] // d, k.shape[-1] // d
    for name, x in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("keys", keys), ("values", values)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    scaled = row_scale is not None
    if scaled and (col_scale is None or col_scale.numel() != (hq + 2 * hkv) * d or not col_scale.is_contiguous()):
        raise ValueError("a float8 product's scales need the rows' and every q|k|v channel's, contiguous")
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    _qk_norm_rope_store_kernel[(n, hq + hkv)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0),
        q_weight, k_weight, cos, sin, cos.stride(0), sin.stride(0),
        slot_mapping, slot_mapping.stride(0), keys, values, keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out, out.stride(0), out.stride(1), eps,
        row_scale if scaled else cos, col_scale if scaled else cos,  # unread unless SCALED
        HQ=hq, HKV=hkv, D=d, BLOCK_SIZE=keys.shape[1],
        SATURATE=float(torch.finfo(keys.dtype).max) if keys.dtype in FLOAT8_TYPES else 0.0, SCALED=scaled,
        num_warps=1,
    )
    return out
