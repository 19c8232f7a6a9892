"""CUDA graphs of a mixed step: decoding requests and a few prompt chunks in one backbone call.

A step that decodes B requests and also takes new prompt chunks replays two graphs otherwise: the
decode step and a prefill graph (`stages.runtime.prefill_graphs`). Each replay pays the backbone's
whole chain of kernels whatever its rows, and under load the chunks are small (a known voice's
prompt comes mostly from the prefix cache: ~50 new rows a step on an H200 at 128 streams, where a
prefill step took 14 ms more than a decode step). `MixedGraphs` records one call for both:
`body(inputs) -> outputs` per bucket (B decode rows, T chunk tokens), where the rows are packed
decode rows first, then the chunks' tokens, as one attention batch of B one-token sequences and
`max_seqs` chunk sequences.

Everything the call reads is one host int64 array copied to the device per step (`_layout`): the
decode rows' request slots and frame counts (the body reads their next rows and sampling state
by slot on the device), the chunks' token ids, every token's position and KV slot, every
sequence's query start, cache lengths, last token and block table, the packed-row index of each
(chunk, token) pair, and for each chunk the request slot and frame count its last token samples
for (the scratch slot when the chunk does not complete its prompt). Padding is inert as in the
decode and prefill graphs: padding decode rows and tokens use the scratch slot and KV block,
padding chunks have no tokens. One block-table width serves every bucket (`table_width`, the
Triton attention's), so the graphs number decode buckets x token buckets.

Without `capture` (any device; the CPU tests) the same padded static inputs run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stages.runtime.attention.metadata import AttentionMetadata
from stages.runtime.graph_capture import (CaptureProgress, StaticCall, batch_bucket, bucket, make_missing, replay_or_build,
                                          sections)
from stages.runtime.prefill_graphs import PrefillChunk

MIN_TOKENS = 16  # the smallest token bucket


@dataclass(frozen=True)
class MixedInputs:
    """The static device inputs a body reads (views of the packed input, valid in every replay).

    dec_slots, dec_frames [B]: the decode rows' request slots and frames made so far.
    ids [T, C]: the chunks' token ids. meta: the attention batch (rows: B decode rows, then T tokens).
    rows [B + S]: the packed row whose hidden state each sampled row takes (decode rows, then each
    chunk's last token). slots, frames [B + S]: the request slot and frame count each sampled row
    samples for."""

    dec_slots: torch.Tensor
    dec_frames: torch.Tensor
    ids: torch.Tensor
    meta: AttentionMetadata
    rows: torch.Tensor
    slots: torch.Tensor
    frames: torch.Tensor


@dataclass
class _Graph:
    packed: torch.Tensor  # flat int64 static input (`_layout`)
    outputs: tuple[torch.Tensor, ...]  # static outputs, rows [B + S]
    call: StaticCall


class MixedGraphs:
    """Per-bucket graphs of `body(MixedInputs) -> outputs` over up to `max_batch` decode rows and
    `max_seqs` chunks of `max_tokens` tokens in all (eager without `capture`). `outputs(rows)`
    makes a bucket's static output tensors, `rows` = B + max_seqs sampled rows."""

    def __init__(self, body: Callable[[MixedInputs], tuple[torch.Tensor, ...]],
                 outputs: Callable[[int], tuple[torch.Tensor, ...]], *, width: int, max_batch: int,
                 max_tokens: int, max_seqs: int, table_width: int, scratch_slot: int, scratch_block: int,
                 block_size: int, device: torch.device, capture: bool = True, pool=None) -> None:
        """width: ids per row (1 + n_vq); table_width: every sequence's block-table width."""
        self.body, self.outputs, self.width = body, outputs, width
        self.max_batch, self.max_tokens, self.max_seqs, self.table_width = max_batch, max_tokens, max_seqs, table_width
        self.scratch_slot, self.scratch_block, self.block_size = scratch_slot, scratch_block, block_size
        self.device, self.capture = device, capture
        self.pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def keys(self) -> list[tuple[int, int]]:
        """(B, T) buckets made so far."""
        return list(self._graphs)

    def token_bucket(self, n: int) -> int:
        """A power of two, at least `MIN_TOKENS`, at most `max_tokens`."""
        return min(max(MIN_TOKENS, bucket(n, self.max_tokens)), self.max_tokens)

    def token_buckets(self) -> list[int]:
        return sorted({self.token_bucket(n) for n in range(1, self.max_tokens + 1)})

    def fits(self, decoding: int, lengths: Sequence[int], blocks: Sequence[int]) -> bool:
        """Whether `decoding` decode rows and chunks of these token counts (block tables `blocks`
        long once written) run as one replay here."""
        return (1 <= decoding <= self.max_batch and 0 < len(lengths) <= self.max_seqs
                and sum(lengths) <= self.max_tokens and min(lengths) >= 1
                and all(b <= self.table_width for b in blocks))

    def run(self, dec_slots: Sequence[int], dec_frames: Sequence[int], dec_positions: Sequence[int],
            dec_kv_slots: Sequence[int], dec_tables: Sequence[Sequence[int]], chunks: Sequence[PrefillChunk],
            ready: Sequence[tuple[int, int] | None]) -> tuple[torch.Tensor, ...]:
        """One replay for n decode rows (slots, frames, positions and KV slots already reserved,
        block tables) and the chunks (KV slots reserved), `ready[i]` the (request slot, frames) that
        chunk i's last token samples for, None when it does not complete its prompt. Returns the
        static outputs (views valid until the next call): rows [0, n) are the decode rows', row
        B + i chunk i's, B = `batch_bucket(n)`."""
        key = (batch_bucket(len(dec_slots), self.max_batch), self.token_bucket(sum(len(c.rows) for c in chunks)))
        host = self._pack(key, dec_slots, dec_frames, dec_positions, dec_kv_slots, dec_tables, chunks, ready)
        return replay_or_build(self._graphs, key, host, self._build).outputs

    def capture_ahead(self, batches: Sequence[int], tokens: Sequence[int], budget_s: float | None = None,
                      progress: CaptureProgress | None = None) -> int:
        """Make the (B, T) buckets of these decode batches and token counts not made yet (every row
        padding: scratch slot and block), largest first, stopping after `budget_s`; how many (each
        counted in `progress`)."""
        keys = {(batch_bucket(b, self.max_batch), self.token_bucket(t)) for b in batches for t in tokens
                if 1 <= b <= self.max_batch and 1 <= t <= self.max_tokens}
        return make_missing(keys, self._graphs,
                            lambda key: self._build(self._pack(key, [], [], [], [], [], [], []), key), budget_s,
                            progress)

    # ---- static layout -------------------------------------------------------------------------

    def _layout(self, B: int, T: int) -> dict[str, slice]:
        """Sections of the flat int64 input: name -> slice. sampled [B + S, 2] (the request slot and
        frame count each sampled row samples for: decode rows, then one per chunk place), ids
        [T, width], one entry per packed row (positions, slot_mapping: B + T), per sequence
        (qstart: B + S + 1; seq_lens, context_lens, last: B + S), tables [B + S, table_width],
        pairs [S, max_tokens]."""
        S, N, Q = self.max_seqs, B + T, self.max_tokens
        sizes = [("sampled", 2 * (B + S)), ("ids", T * self.width), ("positions", N), ("slot_mapping", N),
                 ("qstart", B + S + 1), ("seq_lens", B + S), ("context_lens", B + S), ("last", B + S),
                 ("tables", (B + S) * self.table_width), ("pairs", S * Q)]
        return sections(sizes)

    def _pack(self, key: tuple[int, int], dec_slots, dec_frames, dec_positions, dec_kv_slots, dec_tables,
              chunks: Sequence[PrefillChunk], ready) -> torch.Tensor:
        """The host input of one step in bucket `key` (module docstring)."""
        B, T = key
        S, M, lay = self.max_seqs, self.table_width, self._layout(*key)
        scratch_kv = self.scratch_block * self.block_size
        flat = np.zeros(lay["size"].stop, dtype=np.int64)
        n, lengths = len(dec_slots), [len(c.rows) for c in chunks]
        t = sum(lengths)
        sampled = flat[lay["sampled"]].reshape(B + S, 2)  # decode rows, then one per chunk place
        sampled[:, 0] = self.scratch_slot
        sampled[:n, 0], sampled[:n, 1] = dec_slots, dec_frames
        if t:
            flat[lay["ids"]].reshape(T, self.width)[:t] = np.concatenate([c.rows for c in chunks])
        positions, kv = flat[lay["positions"]], flat[lay["slot_mapping"]]
        kv[:] = scratch_kv  # padding rows and tokens: the scratch block, position 0
        positions[:n], kv[:n] = dec_positions, dec_kv_slots
        qstart = flat[lay["qstart"]]
        qstart[: B + 1] = np.arange(B + 1)  # decode row i is sequence i, one token
        qstart[B + 1: B + 1 + len(chunks)] = B + np.cumsum(lengths, dtype=np.int64)
        qstart[B + 1 + len(chunks):] = B + t  # padding chunks: no tokens
        seq_lens, context, last = flat[lay["seq_lens"]], flat[lay["context_lens"]], flat[lay["last"]]
        seq_lens[:B] = 1  # padding decode rows: one token on the scratch block
        seq_lens[:n] = np.asarray(dec_positions, dtype=np.int64) + 1
        context[:n] = dec_positions
        last[:B] = np.arange(B)
        tables = flat[lay["tables"]].reshape(B + S, M)
        tables[:] = self.scratch_block
        for i, table in enumerate(dec_tables):
            tables[i, : len(table)] = table
        pairs = flat[lay["pairs"]].reshape(S, self.max_tokens)
        pairs[:] = B + T  # past every row: masked
        for i, (c, q) in enumerate(zip(chunks, lengths)):
            a = int(qstart[B + i])
            positions[a: a + q] = np.arange(c.start, c.start + q)
            kv[a: a + q] = c.slots
            seq_lens[B + i], context[B + i], last[B + i] = c.start + q, c.start, a + q - 1
            tables[B + i, : len(c.table)] = c.table
            pairs[i, :q] = np.arange(a, a + q)
            if ready[i] is not None:
                sampled[B + i] = ready[i]
        return torch.from_numpy(flat)

    def _build(self, host: torch.Tensor, key: tuple[int, int]) -> _Graph:
        """The bucket's static tensors and metadata, its graph recorded (with capture) and this
        call's result."""
        B, T = key
        S, dev, lay = self.max_seqs, self.device, self._layout(*key)
        packed = host.to(dev)
        sampled = packed[lay["sampled"]].view(B + S, 2)
        pairs = packed[lay["pairs"]].view(S, self.max_tokens)
        last = packed[lay["last"]]
        seqs = torch.arange(B + S, device=dev)
        span = self.table_width * self.block_size
        meta = AttentionMetadata(
            seq_ids=tuple(range(B + S)),
            query_start_loc=packed[lay["qstart"]],
            seq_lens=packed[lay["seq_lens"]],
            context_lens=packed[lay["context_lens"]],
            block_tables=packed[lay["tables"]].view(B + S, self.table_width),
            slot_mapping=packed[lay["slot_mapping"]],
            positions=packed[lay["positions"]],
            last_token_index=last,
            decode_rows=seqs[:B],
            decode_seqs=seqs[:B],
            prefill_seqs=seqs[B:],
            prefill_rows=pairs,
            prefill_valid=pairs < B + T,  # rewritten in every call of the body
            query_lens_host=(1,) * B + (self.max_tokens,) * S,  # upper bounds: backends read tensors
            seq_lens_host=(span,) * (B + S),
            max_query_len=self.max_tokens,
            max_seq_len=span,
        )
        inputs = MixedInputs(dec_slots=sampled[:B, 0], dec_frames=sampled[:B, 1],
                             ids=packed[lay["ids"]].view(T, self.width), meta=meta, rows=last,
                             slots=sampled[:, 0], frames=sampled[:, 1])

        def body() -> tuple[torch.Tensor, ...]:
            torch.lt(pairs, B + T, out=meta.prefill_valid)  # this call's (chunk, token) pairs
            return self.body(inputs)

        outputs = self.outputs(B + S)
        call = StaticCall.first(body, outputs, capture=self.capture, pool=self.pool, device=dev)
        g = self._graphs[key] = _Graph(packed, outputs, call)
        return g
