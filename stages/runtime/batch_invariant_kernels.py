"""The Triton kernels of the batch-invariant mode (`stages.runtime.batch_invariant`).

Imported only when a kernel first runs, so that importing the backbone never imports triton.
Every kernel sums a row (or an output element) in an order fixed by constexpr shapes that do not
depend on the number of rows: the grid grows with the rows, the program does not change. Integer
arguments that carry the row count are excluded from Triton's value specialisation
(`do_not_specialize`), so one compiled kernel serves every batch size. On CPU (Triton's
interpreter, tests) dot operands are upcast to fp32: the interpreter's bf16 `tl.dot` is wrong.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# ---------------------------------------------------------------- matmul


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (m tile, n tile): c[rows, cols] = a[rows, :] @ b[cols, :]^T, K in BLOCK_K steps
    from 0 (the same steps for every row), fp32 accumulator."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptr + rm.to(tl.int64)[:, None] * stride_am + (k0 + rk)[None, :] * stride_ak,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptr + rn.to(tl.int64)[None, :] * stride_bn + (k0 + rk)[:, None] * stride_bk,
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, tiles) -> None:
    """out [M, N] = a [M, K] @ b [N, K]^T (+ bias [N]) with the fixed `tiles`
    (`stages.runtime.batch_invariant.MatmulTiles`)."""
    M, K = a.shape
    N = b.shape[0]
    if M == 0:
        return
    grid = (triton.cdiv(M, tiles.block_m), triton.cdiv(N, tiles.block_n))
    on_cpu = a.device.type == "cpu"
    extra = {} if on_cpu else dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    _matmul_kernel[grid](
        a, b, bias if bias is not None else a, out, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None, DOT_FP32=on_cpu, **extra,
    )


# ---------------------------------------------------------------- RMSNorm / LayerNorm


@triton.jit
def _row_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, D, eps, stride_x, stride_y,
                     RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program r: row r of x normalised. RMS: w * (x * rsqrt(mean(x^2) + eps)).to(x dtype);
    else LayerNorm: (x - mean) * rsqrt(var + eps) * w + b, all in fp32."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    x = tl.load(x_ptr + row * stride_x + d, mask=ok, other=0.0)
    x32 = x.to(tl.float32)
    if RMS:
        r = tl.math.rsqrt(tl.sum(x32 * x32, 0) / D + eps)
        y = (x32 * r).to(x.dtype).to(tl.float32)
        if HAS_W:
            y = y * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    else:
        mean = tl.sum(x32, 0) / D
        xc = tl.where(ok, x32 - mean, 0.0)
        y = xc * tl.math.rsqrt(tl.sum(xc * xc, 0) / D + eps)
        if HAS_W:
            y = y * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + d, y.to(y_ptr.dtype.element_ty), mask=ok)


def row_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
             rms: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] -> [..., D] normalised per row (RMSNorm or LayerNorm), `out_dtype`."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)  # [R, D]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        _row_norm_kernel[(x2.shape[0],)](
            x2, weight if weight is not None else x2, bias if bias is not None else x2, y, D, float(eps),
            x2.stride(0), y.stride(0), RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None,
            BLOCK_D=_pow2(D))
    return y.view(x.shape)


# ---------------------------------------------------------------- scans and sums


@triton.jit
def _row_reduce_kernel(x_ptr, y_ptr, L, SCAN: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: row r of a contiguous [R, L] x; SCAN: y[r, :] = inclusive cumsum, chunks of
    BLOCK carried in order; else y[r] = sum (BLOCK partial sums, then one tree)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    carry = tl.sum(acc, 0)  # an fp32 scalar 0
    for start in range(0, L, BLOCK):
        ok = start + i < L
        x = tl.load(x_ptr + row * L + start + i, mask=ok, other=0.0).to(tl.float32)
        if SCAN:
            c = tl.cumsum(x, 0) + carry
            tl.store(y_ptr + row * L + start + i, c.to(y_ptr.dtype.element_ty), mask=ok)
            carry = tl.sum(tl.where(i == BLOCK - 1, c, 0.0), 0)  # the chunk's last prefix, exactly
        else:
            acc += x
    if not SCAN:
        tl.store(y_ptr + row, tl.sum(acc, 0).to(y_ptr.dtype.element_ty))


def row_reduce(x: torch.Tensor, dim: int, *, scan: bool, block: int, keepdim: bool) -> torch.Tensor:
    """cumsum (scan) or sum of floating x along `dim`, each row in a fixed order."""
    dim = dim % x.dim() if x.dim() else 0
    moved = x.movedim(dim, -1).contiguous() if x.dim() else x.reshape(1)
    L = moved.shape[-1]
    rows = moved.reshape(-1, L)  # [R, L]
    if scan:
        y = torch.empty_like(rows)
    else:
        y = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0] and L:
        _row_reduce_kernel[(rows.shape[0],)](rows, y, L, SCAN=scan, BLOCK=min(block, _pow2(L)))
    elif not scan:
        y.zero_()
    if scan:
        return y.view(moved.shape).movedim(-1, dim)
    out = y.view(moved.shape[:-1])
    return out.unsqueeze(dim) if keepdim else out


# ---------------------------------------------------------------- small dense attention


@triton.jit
def _dense_attention_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, H, Q, L, scale,
    sqb, sqh, sqq, skb, skh, skl, svb, svh, svl, smb, smh, smq, sml, sob, soh, soq,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Program (b * H + h, query): softmax(q k^T * scale) v over the L keys of (b, h), fp32."""
    bh, qi = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_L)
    d_ok, n_ok = d < HEAD_DIM, n < L
    q = tl.load(q_ptr + b * sqb + h * sqh + qi * sqq + d, mask=d_ok, other=0.0).to(tl.float32)
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + b * skb + h * skh + n[:, None] * skl + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    s = tl.sum(k * q[None, :], 1) * scale  # [BLOCK_L]
    allowed = n_ok
    if HAS_MASK:
        allowed = allowed & (tl.load(m_ptr + b * smb + h * smh + qi * smq + n * sml, mask=n_ok, other=0) != 0)
    if CAUSAL:
        allowed = allowed & (n <= qi)
    s = tl.where(allowed, s, float("-inf"))
    m = tl.max(s, 0)
    p = tl.where(allowed, tl.exp(s - tl.where(m == float("-inf"), 0.0, m)), 0.0)
    total = tl.sum(p, 0)
    v = tl.load(v_ptr + b * svb + h * svh + n[:, None] * svl + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    o = tl.sum(p[:, None] * v, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * sob + h * soh + qi * soq + d, o.to(o_ptr.dtype.element_ty), mask=d_ok)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    is_causal: bool, scale: float) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, H, L, D] (any strides, last one 1 after a copy if needed), bool mask
    broadcastable to [B, H, Q, L] -> [B, H, Q, D] in q's dtype. A row with no allowed key is 0."""
    B, H, Q, D = q.shape
    L = k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o = torch.empty(B, H, Q, D, dtype=q.dtype, device=q.device)
    m = mask.expand(B, H, Q, L).to(torch.int8) if mask is not None else q  # [B, H, Q, L]
    ms = m.stride() if mask is not None else (0, 0, 0, 0)
    if B * H * Q:
        _dense_attention_kernel[(B * H, Q)](
            q, k, v, m, o, H, Q, L, float(scale),
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), *ms, o.stride(0), o.stride(1), o.stride(2),
            HAS_MASK=mask is not None, CAUSAL=is_causal, HEAD_DIM=D, BLOCK_D=_pow2(D), BLOCK_L=_pow2(L))
    return o
