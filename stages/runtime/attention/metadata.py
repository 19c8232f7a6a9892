"""How one backbone call packs a mixed batch, and the seam every attention backend implements.

One backbone call packs the new tokens of many sequences into one `[N, ...]` batch: prefill
chunks of newly admitted requests next to the single decode token of each running request.
`AttentionMetadata` describes that packing (query lengths, context lengths, block tables, the
flat KV slot of every new token, positions). It is built on the host from lengths the scheduler
already knows, then copied to the device once, so building it never waits on the GPU.

The seam (`AttentionBackend`): a callable
`backend(q [N, Hq, D], k_pool, v_pool [num_blocks, block_size, Hkv, D], meta, scale) -> [N, Hq, D]`
called *after* the layer has written this step's keys/values into the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

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
    # host: every row of q is a new token of some sequence (no padding rows), so an attention
    # kernel writes every row of its output and need not clear it first
    every_row_attends: bool = False

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
        every_row_attends=True,  # exactly the batch's new tokens, no padding
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
