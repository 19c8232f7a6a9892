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
definition of correct. `BatchedDecodeAttention` handles all 1-token (decode) sequences of a step
in one padded SDPA call without host loops (prefill chunks still go through the reference path);
a Triton / FlexAttention paged kernel plugs in at the same seam and must agree with the
reference (tests compare them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from stages.kv_cache import PagedKVCache


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


class BatchedDecodeAttention:
    """Decode tokens of all sequences in one SDPA call; prefill chunks through the reference.

    The 1-token sequences' blocks are gathered into a padded `[n, max_blocks * block_size]` K/V
    (keys past a sequence's length masked out); no per-sequence host loop, so the decode part
    is a fixed sequence of kernels for a given (n, max_blocks).
    """

    def __init__(self) -> None:
        self._reference = ReferenceAttention()

    def __call__(self, q, k_pool, v_pool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        n_decode = meta.decode_seqs.shape[0]
        if n_decode < len(meta.query_lens_host):  # some prefill chunks: reference for those
            out = self._reference(q, k_pool, v_pool, meta, scale)
        else:
            out = torch.empty_like(q)
        if n_decode == 0:
            return out
        rep = q.shape[1] // k_pool.shape[2]
        tables = meta.block_tables[meta.decode_seqs].long()  # [n, max_blocks]
        k = k_pool[tables].flatten(1, 2).repeat_interleave(rep, dim=2)  # [n, L, Hq, D]
        v = v_pool[tables].flatten(1, 2).repeat_interleave(rep, dim=2)
        lens = meta.seq_lens[meta.decode_seqs]  # [n]
        mask = torch.arange(k.shape[1], device=q.device)[None, :] < lens[:, None]  # [n, L]
        qd = q[meta.decode_rows].unsqueeze(2)  # [n, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            qd, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), attn_mask=mask[:, None, None, :],
            scale=scale,
        )  # [n, Hq, 1, D]
        out[meta.decode_rows] = o.squeeze(2)
        return out
