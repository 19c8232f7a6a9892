"""CUDA graphs of a backbone prefill call: the prompt chunks of one step -> their hidden states.

A step's prefill chunks run one backbone call over their packed rows. Eager, that call is bound by
the host (measured on an H200: 55 ms for a 170-row prompt, 11 ms of it on the GPU: the compiled
layer halves' guards and wrappers, attention launches, metadata copies). `PrefillGraphs` records
`forward(ids [T, C], meta) -> hidden [T, H]` per bucket (T tokens, M KV blocks per sequence) with
room for `max_seqs` chunks of at most `max_chunk` tokens each, so a step replays one graph.

Everything the call reads is one host int64 array copied to the device per step: the rows' ids,
every token's position and KV slot, each chunk's query start, sequence and context length, last
token and block table, and the packed-row index of each (chunk, token) pair. Padding is inert:
padding tokens feed id 0 at position 0 and write their keys and values into a scratch KV block
that no sequence reads; padding chunks have no tokens (query length 0, sequence length 0), so the
attention backends do no work for them and write nothing; the (chunk, token) pairs past a chunk's
length point at a padding token's row or are masked. Shapes depend only on the bucket, so the
attention backends launch identically on every replay (both read only tensors here).

Token buckets are powers of two up to `TOKEN_STEP`, then multiples of it, so a step pads at most
`TOKEN_STEP` tokens (a 1123-token step replays 1280, not 2048). With `table_width` every bucket
holds block tables of that width: for an attention backend that reads a table only as far as the
sequence's length (the Triton kernel) a wider table costs nothing, and one width means one graph
per token bucket; without it the table width is bucketed too (`PaddedBatchAttention` gathers whole
tables, so there the width is the cost).

Without `capture` (any device; the CPU tests) the same padded static inputs run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stages.runtime.attention.metadata import AttentionMetadata
from stages.runtime.graph_capture import CaptureProgress, StaticCall, bucket, make_missing, replay_or_build, sections

MIN_TOKENS = 16  # the smallest token bucket
TOKEN_STEP = 256  # token buckets past this are its multiples


def token_bucket(n: int, cap: int) -> int:
    """The token bucket of a step of `n` tokens: a power of two (at least `MIN_TOKENS`) up to
    `TOKEN_STEP`, then the next multiple of `TOKEN_STEP`; at most `cap` (n itself past it)."""
    b = max(MIN_TOKENS, bucket(n, TOKEN_STEP)) if n <= TOKEN_STEP else -(-n // TOKEN_STEP) * TOKEN_STEP
    return min(b, cap) if n <= cap else n


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One prompt chunk of a step: its rows [n, C], the sequence's cache length before it
    (`start`), the KV slots reserved for its n tokens, and the sequence's block table."""

    rows: np.ndarray
    start: int
    slots: Sequence[int]
    table: Sequence[int]


@dataclass
class _Graph:
    packed: torch.Tensor  # [size] int64 static input (see `_layout`)
    hidden: torch.Tensor  # [T, H] static output
    call: StaticCall  # forward(ids, meta) -> (hidden,), recorded with capture


class PrefillGraphs:
    """Per-bucket graphs of `forward(ids [T, C], meta) -> hidden [T, H]` over up to `max_seqs`
    prefill chunks of at most `max_chunk` tokens, `max_tokens` in all (eager without `capture`)."""

    def __init__(self, forward: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor], *, width: int,
                 hidden_size: int, dtype: torch.dtype, max_tokens: int, max_seqs: int, max_chunk: int,
                 max_blocks: int, scratch_block: int, block_size: int, device: torch.device,
                 capture: bool = True, pool=None, table_width: int | None = None) -> None:
        """width: ids per row (1 + n_vq); max_blocks: KV blocks a sequence can hold at most;
        table_width: every bucket's block-table width (module docstring; None: bucketed)."""
        self.forward, self.width, self.hidden_size, self.dtype = forward, width, hidden_size, dtype
        self.max_tokens, self.max_seqs, self.max_chunk = max_tokens, max_seqs, max_chunk
        self.max_blocks, self.scratch_block, self.block_size = max_blocks, scratch_block, block_size
        self.device, self.capture = device, capture
        self.table_width = None if table_width is None else min(table_width, max_blocks)
        self.pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def keys(self) -> list[tuple[int, int]]:
        """(T, M) buckets made so far."""
        return list(self._graphs)

    def fits(self, lengths: Sequence[int], blocks: Sequence[int] = ()) -> bool:
        """Whether chunks of these token counts, whose sequences' block tables will be `blocks`
        long, run here (else: the caller's eager call)."""
        return (0 < len(lengths) <= self.max_seqs and sum(lengths) <= self.max_tokens
                and all(1 <= n <= self.max_chunk for n in lengths)
                and (self.table_width is None or all(b <= self.table_width for b in blocks)))

    def token_buckets(self) -> list[int]:
        """Every token bucket, smallest first."""
        return sorted({token_bucket(t, self.max_tokens) for t in range(1, self.max_tokens + 1)})

    def key(self, tokens: int, blocks: int) -> tuple[int, int]:
        """The (T, M) bucket of a step with this many tokens and its longest block table."""
        width = self.table_width if self.table_width is not None else bucket(blocks, self.max_blocks)
        return token_bucket(tokens, self.max_tokens), width

    def run(self, chunks: Sequence[PrefillChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks (KV slots already reserved) through one replay: (hidden [T, H], last [len(chunks)])
        where `hidden[last[i]]` is chunk i's last token's state; views of static tensors, valid until
        the next call. Rows past the chunks' tokens are padding."""
        key = self.key(sum(len(c.rows) for c in chunks), max(len(c.table) for c in chunks))
        host = self._pack(chunks, *key)
        g = replay_or_build(self._graphs, key, host, self._build)
        lay = self._layout(*key)
        return g.hidden, g.packed[lay["last"]][: len(chunks)]

    def capture_ahead(self, tokens: Sequence[int], blocks: Sequence[int], budget_s: float | None = None,
                      progress: CaptureProgress | None = None) -> int:
        """Make the (T, M) buckets of these token counts and block-table widths not made yet, with
        one scratch-only chunk each (its keys go to the scratch block), largest first, stopping
        after `budget_s`; returns how many (each counted in `progress`)."""
        scratch = PrefillChunk(np.zeros((1, self.width), dtype=np.int64), 0, [self.scratch_block * self.block_size],
                               [self.scratch_block])
        return make_missing({self.key(t, b) for t in tokens for b in blocks}, self._graphs,
                            lambda key: self._build(self._pack([scratch], *key), key), budget_s, progress)

    # ---- static layout -------------------------------------------------------------------------

    def _layout(self, T: int, M: int) -> dict[str, slice]:
        """Sections of the flat int64 input: name -> slice (ids are [T, width], tables [S, M],
        pairs [S, max_chunk], the rest one entry per token or per chunk)."""
        S, Q = self.max_seqs, self.max_chunk
        sizes = [("ids", T * self.width), ("positions", T), ("slot_mapping", T), ("qstart", S + 1),
                 ("seq_lens", S), ("context_lens", S), ("last", S), ("tables", S * M), ("pairs", S * Q)]
        return sections(sizes)

    def _pack(self, chunks: Sequence[PrefillChunk], T: int, M: int) -> torch.Tensor:
        """The host input of these chunks in bucket (T, M)."""
        lay, S, Q = self._layout(T, M), self.max_seqs, self.max_chunk
        flat = np.zeros(lay["size"].stop, dtype=np.int64)
        lengths = [len(c.rows) for c in chunks]
        n = sum(lengths)
        ids = flat[lay["ids"]].reshape(T, self.width)
        ids[:n] = np.concatenate([c.rows for c in chunks])
        positions, slots = flat[lay["positions"]], flat[lay["slot_mapping"]]
        slots[n:] = self.scratch_block * self.block_size  # padding tokens: the scratch block
        qstart = np.zeros(S + 1, dtype=np.int64)
        qstart[1: len(chunks) + 1] = np.cumsum(lengths)
        qstart[len(chunks) + 1:] = n  # padding chunks: no tokens
        flat[lay["qstart"]] = qstart
        seq_lens, context, last = flat[lay["seq_lens"]], flat[lay["context_lens"]], flat[lay["last"]]
        tables = flat[lay["tables"]].reshape(S, M)
        tables[:] = self.scratch_block
        pairs = flat[lay["pairs"]].reshape(S, Q)
        pairs[:] = T  # past every token: masked (the scratch row of the padded backend)
        for i, (c, q) in enumerate(zip(chunks, lengths)):
            a = qstart[i]
            positions[a: a + q] = np.arange(c.start, c.start + q)
            slots[a: a + q] = c.slots
            seq_lens[i], context[i], last[i] = c.start + q, c.start, a + q - 1
            tables[i, : len(c.table)] = c.table
            pairs[i, :q] = np.arange(a, a + q)
        return torch.from_numpy(flat)

    def _build(self, host: torch.Tensor, key: tuple[int, int]) -> _Graph:
        """The bucket's static tensors, its graph recorded (with capture) and this call's result."""
        T, M = key
        S, dev = self.max_seqs, self.device
        packed = host.to(dev)
        lay = self._layout(T, M)
        ids = packed[lay["ids"]].view(T, self.width)
        pairs = packed[lay["pairs"]].view(S, self.max_chunk)
        seqs = torch.arange(S, device=dev)
        meta = AttentionMetadata(
            seq_ids=tuple(range(S)),
            query_start_loc=packed[lay["qstart"]],
            seq_lens=packed[lay["seq_lens"]],
            context_lens=packed[lay["context_lens"]],
            block_tables=packed[lay["tables"]].view(S, M),
            slot_mapping=packed[lay["slot_mapping"]],
            positions=packed[lay["positions"]],
            last_token_index=packed[lay["last"]],
            decode_rows=seqs[:0],
            decode_seqs=seqs[:0],
            prefill_seqs=seqs,
            prefill_rows=pairs,
            prefill_valid=pairs < T,  # a view-free tensor made once: see _body
            query_lens_host=(self.max_chunk,) * S,  # upper bounds; the backends read tensors only
            seq_lens_host=(M * self.block_size,) * S,
            max_query_len=self.max_chunk,
            max_seq_len=M * self.block_size,
        )
        hidden = torch.empty(T, self.hidden_size, dtype=self.dtype, device=dev)

        def body() -> tuple[torch.Tensor]:
            torch.lt(pairs, T, out=meta.prefill_valid)  # this replay's (chunk, token) pairs
            return (self.forward(ids, meta),)

        call = StaticCall.first(body, (hidden,), capture=self.capture, pool=self.pool, device=dev)
        g = self._graphs[key] = _Graph(packed, hidden, call)
        return g
