"""Attention over the paged KV cache for a mixed batch, and its plain reference implementation.

One backbone call packs the new tokens of many sequences into one `[N, ...]` batch: prefill
chunks of newly admitted requests next to the single decode token of each running request.
`AttentionMetadata` describes that packing (query lengths, context lengths, block tables, the
flat KV slot of every new token, positions). It is built on the host from lengths the scheduler
already knows, then copied to the device once, so building it never waits on the GPU.

The seam: an attention backend is a callable
`backend(q [N, Hq, D], k_pool, v_pool [num_blocks, block_size, Hkv, D], meta, scale) -> [N, Hq, D]`
called *after* the layer has written this step's keys/values into the pool. `ReferenceAttention`
gathers each sequence's K/V from its blocks and runs `F.scaled_dot_product_attention`; it is the
definition of correct. `PaddedBatchAttention` has no per-sequence host loop: the 1-token (decode)
sequences of a step form one padded batch and the prefill chunks another, each attended with
grouped-query matmuls over K/V gathered from the blocks; it is graph-capturable.
`stages.runtime.attention.triton_paged.TritonPagedAttention` (Triton paged kernel, no gather, CUDA) plugs in at
the same seam and must agree with the reference (tests compare them); `make_attention` picks the
backend a profile's `talker.attention` names.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from stages.runtime.kv_cache import PagedKVCache


@dataclass(frozen=True)
class AttentionMetadata:
    """Packing of one mixed batch of B sequences and N new tokens (device tensors + host copies)."""

    seq_ids: tuple[int, ...]
    query_start_loc: torch.Tensor  # [B + 1] int32: new tokens of sequence i are rows [qs[i], qs[i+1])
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step (context + new)
    context_lens: torch.Tensor  # [B] int32: tokens in the cache before this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [N] int64: flat pool slot of every new token
    positions: torch.Tensor  # [N] int64: position of every new token in its sequence
    last_token_index: torch.Tensor  # [B] int64: row of each sequence's last new token
    decode_rows: torch.Tensor  # [n_decode] int64: rows of the sequences with one new token
    decode_seqs: torch.Tensor  # [n_decode] int64: their sequence indices
    prefill_seqs: torch.Tensor  # [n_prefill] int64: sequences with more than one new token
    prefill_rows: torch.Tensor  # [n_prefill, max_q] int64: row of each of their tokens (0 on padding)
    prefill_valid: torch.Tensor  # [n_prefill, max_q] bool: False on padding
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_host))

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)


def build_attention_metadata(
    cache: PagedKVCache, batch: Sequence[tuple[int, int]], device: torch.device | str
) -> AttentionMetadata:
    """Reserve KV slots for `batch` = [(seq_id, num_new_tokens), ...] and describe the packing.

    New tokens are packed in the order given. Positions continue each sequence's cache length
    (token i of a sequence sits at position i, i.e. cumsum(attention_mask) - 1 without padding).
    """
    if not batch:
        raise ValueError("empty batch")
    seq_ids, qlens, ctx, slens, slots, positions, tables = [], [], [], [], [], [], []
    for seq_id, n_new in batch:
        if n_new <= 0:
            raise ValueError(f"sequence {seq_id}: {n_new} new tokens")
        start, new_slots = cache.append_slots(seq_id, n_new)
        seq_ids.append(seq_id)
        qlens.append(n_new)
        ctx.append(start)
        slens.append(start + n_new)
        slots.extend(new_slots)
        positions.extend(range(start, start + n_new))
        tables.append(cache.block_table(seq_id))
    max_blocks = max(len(t) for t in tables)
    table_rows = [t + [0] * (max_blocks - len(t)) for t in tables]
    qstart = [0]
    for q in qlens:
        qstart.append(qstart[-1] + q)

    def dev(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    decode_seqs = [i for i, q in enumerate(qlens) if q == 1]
    prefill_seqs = [i for i, q in enumerate(qlens) if q > 1]
    width = max((qlens[i] for i in prefill_seqs), default=0)
    prefill_rows = [[qstart[i] + j if j < qlens[i] else 0 for j in range(width)] for i in prefill_seqs]
    prefill_valid = [[j < qlens[i] for j in range(width)] for i in prefill_seqs]
    return AttentionMetadata(
        seq_ids=tuple(seq_ids),
        query_start_loc=dev(qstart, torch.int32),
        seq_lens=dev(slens, torch.int32),
        context_lens=dev(ctx, torch.int32),
        block_tables=dev(table_rows, torch.int32),
        slot_mapping=dev(slots, torch.int64),
        positions=dev(positions, torch.int64),
        last_token_index=dev([s - 1 for s in qstart[1:]], torch.int64),
        decode_rows=dev([qstart[i] for i in decode_seqs], torch.int64),
        decode_seqs=dev(decode_seqs, torch.int64),
        prefill_seqs=dev(prefill_seqs, torch.int64),
        prefill_rows=dev(prefill_rows, torch.int64).view(len(prefill_seqs), width),
        prefill_valid=dev(prefill_valid, torch.bool).view(len(prefill_seqs), width),
        query_lens_host=tuple(qlens),
        seq_lens_host=tuple(slens),
        max_query_len=max(qlens),
        max_seq_len=max(slens),
    )


class AttentionBackend(Protocol):
    """Causal attention of the packed new tokens over their sequences' cached K/V."""

    def __call__(
        self,
        q: torch.Tensor,  # [N, Hq, D]
        k_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_pool: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [N, Hq, D]
        ...


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
    so a decode-only step is graph-capturable.
    """

    def __call__(self, q, k_pool, v_pool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
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
            o = grouped_attention(q[rows], k, v, allowed, scale)  # [n, Q, Hq, D]
            if valid is None:
                out[rows[:, 0]] = o[:, 0]
            else:
                out[rows[valid]] = o[valid]
        return out


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
