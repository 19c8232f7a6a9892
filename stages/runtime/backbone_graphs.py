"""CUDA graphs of a backbone decode step: one new row per decoding request -> its hidden state.

For the talkers whose sampling stays on the host's side of a step (Delay: per-request state
machine and text rules; Realtime: its depth loop), the backbone is where a decode step's kernel
launches are (every layer's norms, projections, attention and MLP). `BackboneGraphs` records
`forward(ids [B, C], meta) -> hidden [B, H]` per (B, M) bucket (`stages.runtime.graph_capture`): the rows'
ids and the packed attention inputs are one host array copied to the device per step; padding rows
feed id 0 (a valid row of every embedding) through the scratch KV block.

Without `capture` (any device; the CPU tests) the same padded static inputs run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from stages.runtime.attention.metadata import AttentionMetadata
from stages.runtime.graph_capture import (CaptureProgress, StaticCall, batch_bucket, decode_metadata, make_missing,
                                          pack_decode_inputs, replay_or_build, table_bucket)


@dataclass
class _Graph:
    packed: torch.Tensor  # [B, C + 5 + M] int64 static input: row ids, then pack_decode_inputs' layout
    hidden: torch.Tensor  # [B, H] static output
    call: StaticCall  # forward(ids, meta) -> (hidden,), recorded with capture


class BackboneGraphs:
    """Per-bucket graphs of `forward(ids [B, C], meta) -> hidden [B, H]` (eager without `capture`)."""

    def __init__(self, forward: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor], *, width: int,
                 hidden_size: int, dtype: torch.dtype, max_batch: int, max_blocks: int, scratch_block: int,
                 block_size: int, device: torch.device, capture: bool = True, table_width: int | None = None) -> None:
        """width: ids per row (1 + n_vq); max_blocks: KV blocks a request can hold at most;
        table_width: one block-table width for every table that fits it (`graph_capture.table_bucket`)."""
        self.forward, self.width, self.hidden_size, self.dtype = forward, width, hidden_size, dtype
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.table_width = None if table_width is None else min(table_width, max_blocks)
        self.scratch_block, self.block_size, self.device, self.capture = scratch_block, block_size, device, capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def keys(self) -> list[tuple[int, int]]:
        """(B, M) buckets made so far."""
        return list(self._graphs)

    def run(self, rows: np.ndarray, positions: list[int], slot_mapping: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """rows [n, C] int64 (each request's new row), their positions and KV slots (already
        reserved) and block tables -> hidden [n, H]: a view of the static output, valid until the
        next call."""
        n = len(rows)
        key = (batch_bucket(n, self.max_batch),
               table_bucket(max(len(t) for t in tables), self.max_blocks, self.table_width))
        # the request-slot and frame columns are unused here (no per-request state inside the graph)
        packed = pack_decode_inputs([0] * n, [0] * n, positions, slot_mapping, [p + 1 for p in positions], tables,
                                    batch=key[0], blocks=key[1], scratch_slot=0, scratch_block=self.scratch_block,
                                    block_size=self.block_size)  # [B, 5 + M]
        ids = np.zeros((key[0], self.width), dtype=np.int64)  # padding rows: id 0
        ids[:n] = rows
        host = torch.cat([torch.from_numpy(ids), packed], dim=1)  # [B, C + 5 + M]
        g = replay_or_build(self._graphs, key, host, self._build)
        return g.hidden[:n]

    def capture_ahead(self, batches: list[int], blocks: list[int], budget_s: float | None = None,
                      progress: CaptureProgress | None = None) -> int:
        """Make the (B, M) buckets of these batch sizes and block counts not made yet (padding rows
        only: id 0 on the scratch block), largest first, stopping after `budget_s`; returns how many
        (each counted in `progress`)."""
        keys = {(batch_bucket(b, self.max_batch), table_bucket(m, self.max_blocks, self.table_width))
                for b in batches for m in blocks}

        def make(key: tuple[int, int]) -> None:
            B, M = key
            packed = pack_decode_inputs([], [], [], [], [], [], batch=B, blocks=M, scratch_slot=0,
                                        scratch_block=self.scratch_block, block_size=self.block_size)
            self._build(torch.cat([torch.zeros(B, self.width, dtype=torch.int64), packed], dim=1), key)

        return make_missing(keys, self._graphs, make, budget_s, progress)

    def _build(self, host: torch.Tensor, key: tuple[int, int]) -> _Graph:
        """The bucket's static tensors, its graph recorded (with capture) and this call's result."""
        packed = host.to(self.device)
        hidden = torch.empty(key[0], self.hidden_size, dtype=self.dtype, device=self.device)
        ids, meta = packed[:, : self.width], decode_metadata(packed[:, self.width :], self.block_size)
        call = StaticCall.first(lambda: (self.forward(ids, meta),), (hidden,), capture=self.capture, pool=self.pool,
                                device=self.device)
        g = self._graphs[key] = _Graph(packed, hidden, call)
        return g
