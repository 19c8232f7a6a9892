"""One residual-LFQ stage's nearest code in one kernel (Triton), for reference encodes.

A quantizer stage of the reference encoder is a chain of launches on tiny tensors (v2: 8-wide
codes, 1024 of them): the projected residual copied to rows, L2-normalised (norm, clamp,
divide), its distances to the codebook (square, sum, matmul, two subtractions), the largest
closeness taken, the chosen row gathered, transposed back, and upstream's straight-through sum
`z_e + (chosen - z_e)`: twelve launches a stage, 32 stages an encode, each on a few thousand
values, so a batch of references waits on the host's launches. Here a
program takes a tile of rows (frames), reads them in the in-projection's layout [B, cd, T],
normalises them, walks the codebook in blocks keeping each row's best code (the first of equals,
as `max` does), and writes the code and the straight-through rows in that same layout.

The arithmetic is upstream's: closeness `2 enc.book - |enc|^2 - |book|^2` of the normalised row and
the normalised codebook (`LFQStage.normalized_book`), in fp32. Sums of 8 products round in the
kernel's order rather than a matmul library's, so a code can differ where two codes are equally
near to the last bit. On CPU it runs in Triton's interpreter (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["R", "T"])  # one kernel for every batch and clip length
def _lfq_nearest_kernel(
    z_ptr, book2_ptr, book_sq_ptr, codebook_ptr, codes_ptr, out_ptr, R, T, K, CD, eps,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_CD: tl.constexpr,
):
    """Program (tile of BLOCK_R rows r = b * T + t): codes[r], out[b, :, t] = z + (codebook[code] - z)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BLOCK_R]
    c = tl.arange(0, BLOCK_CD)  # [BLOCK_CD]
    row_ok = r < R
    col_ok = c < CD
    ok = row_ok[:, None] & col_ok[None, :]
    at = (r // T * CD * T + r % T)[:, None] + (c * T)[None, :]  # [BLOCK_R, BLOCK_CD]: z[b, c, t]
    z = tl.load(z_ptr + at, mask=ok, other=0.0).to(tl.float32)
    enc = z / tl.maximum(tl.sqrt(tl.sum(z * z, axis=1)), eps)[:, None]  # F.normalize
    enc_sq = tl.sum(enc * enc, axis=1)  # [BLOCK_R]
    best = tl.full([BLOCK_R], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK_R], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_ok = k < K
        book2 = tl.load(book2_ptr + k[:, None] * CD + c[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        dots = tl.sum(enc[:, None, :] * book2[None, :, :], axis=2)  # [BLOCK_R, BLOCK_K]
        book_sq = tl.load(book_sq_ptr + k, mask=k_ok, other=0.0)
        near = tl.where(k_ok[None, :], dots - enc_sq[:, None] - book_sq[None, :], float("-inf"))
        top = tl.max(near, axis=1)
        top_at = tl.argmax(near, axis=1, tie_break_left=True) + k0
        better = top > best  # strictly: an earlier block keeps its equal
        best = tl.where(better, top, best)
        best_at = tl.where(better, top_at, best_at)
    tl.store(codes_ptr + r, best_at.to(tl.int64), mask=row_ok)
    chosen = tl.load(codebook_ptr + best_at.to(tl.int64)[:, None] * CD + c[None, :], mask=ok, other=0.0)
    tl.store(out_ptr + at, z + (chosen.to(tl.float32) - z), mask=ok)


def blocks(device_type: str, codes: int) -> tuple[int, int]:
    """(rows, codes) a program takes: on a GPU a few thousand products in flight; the interpreter
    runs each program in numpy, so few large ones there."""
    return (128, triton.next_power_of_2(codes)) if device_type == "cpu" else (16, 64)


def lfq_nearest(z_e: torch.Tensor, book2: torch.Tensor, book_sq: torch.Tensor,
                codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z_e [B, cd, T] fp32 (a stage's in-projection), book2 [K, cd] (2 x the normalised codebook),
    book_sq [1, K] (its rows' squared norms), codebook [K, cd] (the raw rows) -> (the
    straight-through rows `z_e + (codebook[codes] - z_e)` [B, cd, T] fp32, codes [B, T] int64)."""
    B, CD, T = z_e.shape
    K = codebook.shape[0]
    for name, x in (("z_e", z_e), ("book2", book2), ("book_sq", book_sq), ("codebook", codebook)):
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous fp32")
    if book2.shape != (K, CD) or codebook.shape != (K, CD) or book_sq.numel() != K:
        raise ValueError(f"codebook shapes {tuple(book2.shape)}, {tuple(book_sq.shape)}, {tuple(codebook.shape)} "
                         f"do not match {K} codes of {CD}")
    out = torch.empty_like(z_e)
    codes = torch.empty(B, T, dtype=torch.int64, device=z_e.device)
    R = B * T
    if R == 0:
        return out, codes
    block_cd = max(2, triton.next_power_of_2(CD))
    block_r, block_k = blocks(z_e.device.type, K)
    _lfq_nearest_kernel[(triton.cdiv(R, block_r),)](
        z_e, book2, book_sq, codebook, codes, out, R, T, K, CD, 1e-12,
        BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_CD=block_cd)
    return out, codes
