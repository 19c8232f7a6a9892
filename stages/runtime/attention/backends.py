"""The attention backends over the paged KV cache, and `make_attention`, which picks one by name.

`ReferenceAttention` gathers each sequence's K/V from its blocks and runs
`F.scaled_dot_product_attention`; it is the definition of correct. `PaddedBatchAttention` has no
per-sequence host loop: the 1-token (decode) sequences of a step form one padded batch and the
prefill chunks another, each attended with grouped-query matmuls over K/V gathered from the
blocks; it is graph-capturable. `stages.runtime.attention.triton_paged.TritonPagedAttention`
(Triton paged kernel, no gather, CUDA) plugs in at the same seam (`AttentionBackend`,
`stages.runtime.attention.metadata`) and must agree with the reference (tests compare them);
`make_attention` picks the backend a profile's `talker.attention` names.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from stages.runtime.attention.metadata import AttentionBackend, AttentionMetadata


class ReferenceAttention:
    """Plain path: per sequence, gather its K/V from the block table and call SDPA.

    Loops over sequences on the host (it reads the host copies of the lengths); meant for CPU and
    as the reference a fast GPU backend is tested against.
    """

    def __call__(self, q, k_pool, v_pool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        n_q_heads, n_kv_heads = q.shape[1], k_pool.shape[2]
        rep = n_q_heads // n_kv_heads
        block_size = k_pool.shape[1]
        out = torch.empty_like(q)
        row = 0
        for i, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            n_blocks = -(-s_len // block_size)
            blocks = meta.block_tables[i, :n_blocks].long()
            k = k_pool[blocks].flatten(0, 1)[:s_len]  # [S, Hkv, D]
            v = v_pool[blocks].flatten(0, 1)[:s_len]
            k = k.repeat_interleave(rep, dim=1).transpose(0, 1).to(q.dtype)  # [Hq, S, D]
            v = v.repeat_interleave(rep, dim=1).transpose(0, 1).to(q.dtype)
            qi = q[row : row + q_len].transpose(0, 1)  # [Hq, Q, D]
            # query j sits at position s_len - q_len + j and sees keys 0..that position
            q_pos = torch.arange(s_len - q_len, s_len, device=q.device)
            mask = torch.arange(s_len, device=q.device)[None, :] <= q_pos[:, None]  # [Q, S]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)  # [Hq, Q, D]
            out[row : row + q_len] = o.transpose(0, 1)
            row += q_len
        return out


def grouped_attention(
    q: torch.Tensor,  # [n, Q, Hq, D]
    k: torch.Tensor,  # [n, L, Hkv, D]
    v: torch.Tensor,  # [n, L, Hkv, D]
    allowed: torch.Tensor,  # [n, Q, L] bool
    scale: float,
) -> torch.Tensor:  # [n, Q, Hq, D]
    """Masked attention with KV heads shared by groups of query heads, without repeating K/V.
    Softmax in fp32. Every query row must allow at least one key."""
    n, Q, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(n, Q, Hkv, Hq // Hkv, D)
    scores = torch.einsum("nqhrd,nlhd->nhrql", qg, k.to(q.dtype)).float() * scale  # [n, Hkv, rep, Q, L]
    scores = scores.masked_fill(~allowed[:, None, None], -torch.inf)
    probs = scores.softmax(-1).to(q.dtype)
    return torch.einsum("nhrql,nlhd->nqhrd", probs, v.to(q.dtype)).reshape(n, Q, Hq, D)


class PaddedBatchAttention:
    """All decode tokens in one padded batch, all prefill chunks in another; no host loop.

    Each group gathers its sequences' blocks into a padded `[n, max_blocks * block_size]` K/V and
    masks keys past a query's position. Shapes depend only on the group sizes and the block count,
    and padded (chunk, token) pairs write a spare row instead of being masked out of the index, so
    decode steps and padded prefill calls (`stages.runtime.prefill_graphs`) are graph-capturable.
    Rows no sequence covers (padding tokens) come out zero.
    """

    table_width_free = False  # gathers every block of a table: the width is the cost

    def __call__(self, q, k_pool, v_pool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        N = q.shape[0]
        out = torch.zeros(N + 1, *q.shape[1:], dtype=q.dtype, device=q.device)  # row N: padding's
        for seqs, rows, valid in (
            (meta.decode_seqs, meta.decode_rows[:, None], None),
            (meta.prefill_seqs, meta.prefill_rows, meta.prefill_valid),
        ):
            if seqs.shape[0] == 0:
                continue
            tables = meta.block_tables[seqs].long()  # [n, max_blocks]
            k = k_pool[tables].flatten(1, 2)  # [n, L, Hkv, D]
            v = v_pool[tables].flatten(1, 2)
            seq_lens = meta.seq_lens[seqs].long()  # [n]
            width = rows.shape[1]
            # query j of a sequence sits at position seq_len - q_len + j
            q_len = valid.sum(-1) if valid is not None else torch.ones_like(seq_lens)
            q_pos = (seq_lens - q_len)[:, None] + torch.arange(width, device=q.device)  # [n, Q]
            key_pos = torch.arange(k.shape[1], device=q.device)
            allowed = key_pos[None, None, :] <= q_pos[:, :, None]  # [n, Q, L] (implies key < seq_len)
            o = grouped_attention(q[rows.clamp(max=N - 1)], k, v, allowed, scale)  # [n, Q, Hq, D]
            if valid is None:
                out[rows[:, 0]] = o[:, 0]
            else:  # (chunk, token) pairs past a chunk's length write row N: no mask-shaped index
                out[torch.where(valid, rows, N)] = o
        return out[:N]


def make_attention(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend the profile's `talker.attention` names: "padded" | "triton" | "auto".

    "auto" is the Triton paged kernel (`stages.runtime.attention.triton_paged`) when `device` is CUDA and triton
    imports, else `PaddedBatchAttention`. "triton" insists: it raises when triton is missing or the
    device is not CUDA (unless Triton's CPU interpreter is on, `TRITON_INTERPRET=1`, for tests).
    """
    if name not in ("auto", "padded", "triton"):
        raise ValueError(f"unknown attention backend {name!r} (auto, padded, triton)")
    if name == "padded":
        return PaddedBatchAttention()
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto" and not on_cuda:
        return PaddedBatchAttention()
    try:
        from stages.runtime.attention.triton_paged import TritonPagedAttention
    except ImportError:
        if name == "auto":
            return PaddedBatchAttention()
        raise
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention 'triton' needs a CUDA device, got {device}")
    return TritonPagedAttention()
