"""CUDA graphs of the Local-v1.5 decode step: backbone token + local loop + sampling in one replay.

The decoding requests of a step (each feeds one row; prefill chunks of the same step run in a
separate eager call, `stages.models.local_v15.runner`) have fixed shapes once the batch is padded to a
bucket of B (requests) and M (KV blocks per request). One graph per (B, M) bucket
is captured on first use and replayed afterwards. Everything the step reads is a device tensor:
the static inputs below (written with one host-to-device copy per step) and the runner's
slot-indexed state (next rows, sampling settings, repetition history), read by slot inside the
graph. Padding rows point at a scratch request slot and a scratch KV block, so they compute
garbage nobody reads and write only there.

Capture runs the step once eagerly (warm-up) and then records it. Re-running a step is harmless:
KV writes go to the same slots with the same values and the sampling noise is a pure function of
(seed, frame, codebook), so the recorded step is the real one.

With `capture=False` (any device; the CPU tests) nothing is recorded: every call copies its
inputs into the same per-bucket static tensors and runs the same body on them eagerly, so the
bucketing, padding and scratch slot/block logic is exercised exactly as the graphs see it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stages.runtime.attention.metadata import AttentionMetadata
from stages.runtime.graph_capture import (CaptureProgress, StaticCall, batch_bucket, decode_metadata, make_missing,
                                          pack_decode_inputs, replay_or_build, table_bucket)


@dataclass
class _Graph:
    call: StaticCall  # body(slots, frames, meta) -> (stop, codes), recorded with capture
    packed: torch.Tensor  # [B, 5 + M] int64 static input, see DecodeGraphs.pack
    meta: AttentionMetadata
    slots: torch.Tensor  # [B] views into packed
    frames: torch.Tensor
    stop: torch.Tensor  # [B] bool output
    codes: torch.Tensor  # [B, n_vq] int64 output


class DecodeGraphs:
    """Per-bucket CUDA graphs of `body(slots, frames, meta) -> (stop, codes)` (or, without
    `capture`, the body run eagerly on the bucket's static inputs)."""

    def __init__(self, body, *, max_batch: int, max_blocks: int, scratch_slot: int, scratch_block: int,
                 block_size: int, n_vq: int, device: torch.device, capture: bool = True, pool=None,
                 table_width: int | None = None) -> None:
        """`pool`: a graph memory pool to share (None = a new one when capturing). `table_width`:
        one block-table width for every table that fits it (`graph_capture.table_bucket`)."""
        self.body = body
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.table_width = None if table_width is None else min(table_width, max_blocks)
        self.scratch_slot, self.scratch_block, self.block_size = scratch_slot, scratch_block, block_size
        self.n_vq, self.device, self.capture = n_vq, device, capture
        self.pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def keys(self) -> list[tuple[int, int]]:
        """(B, M) buckets made so far."""
        return list(self._graphs)

    def pack(self, slots: list[int], frames: list[int], positions: list[int], slot_mapping: list[int],
             seq_lens: list[int], tables: list[list[int]]) -> tuple[torch.Tensor, tuple[int, int]]:
        """Host tensor [B, 5 + M]: slot, frame, position, kv slot, seq len, block table (padded)."""
        n = len(slots)
        key = (batch_bucket(n, self.max_batch),
               table_bucket(max(len(t) for t in tables), self.max_blocks, self.table_width))
        return pack_decode_inputs(slots, frames, positions, slot_mapping, seq_lens, tables, batch=key[0],
                                  blocks=key[1], scratch_slot=self.scratch_slot, scratch_block=self.scratch_block,
                                  block_size=self.block_size), key

    def capture_ahead(self, batches: list[int], blocks: list[int], budget_s: float | None = None,
                      progress: CaptureProgress | None = None) -> int:
        """Make the (B, M) buckets of these batch sizes and block counts not made yet, every row
        on the scratch slot and block, largest first, stopping after `budget_s`; returns how many
        (each counted in `progress`: `graph_capture.make_missing`)."""
        keys = {(batch_bucket(b, self.max_batch), table_bucket(m, self.max_blocks, self.table_width))
                for b in batches for m in blocks}

        def make(key: tuple[int, int]) -> None:
            self._build(pack_decode_inputs([], [], [], [], [], [], batch=key[0], blocks=key[1],
                                           scratch_slot=self.scratch_slot, scratch_block=self.scratch_block,
                                           block_size=self.block_size), key)

        return make_missing(keys, self._graphs, make, budget_s, progress)

    def run(self, packed_host: torch.Tensor, key: tuple[int, int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay (capturing first if new) the bucket's graph; returns stop [n], codes [n, n_vq]."""
        g = replay_or_build(self._graphs, key, packed_host, self._build)
        return g.stop[:n], g.codes[:n]

    def _build(self, packed_host: torch.Tensor, key: tuple[int, int]) -> _Graph:
        """The bucket's static tensors, its graph recorded (with capture) and this call's results."""
        B, dev = key[0], self.device
        packed = packed_host.to(dev)
        meta = decode_metadata(packed, self.block_size)
        slots, frames = packed[:, 0], packed[:, 1]
        stop = torch.empty(B, dtype=torch.bool, device=dev)
        codes = torch.empty(B, self.n_vq, dtype=torch.int64, device=dev)
        call = StaticCall.first(lambda: self.body(slots, frames, meta), (stop, codes), capture=self.capture,
                                pool=self.pool, device=dev)
        g = _Graph(call, packed, meta, slots, frames, stop, codes)
        self._graphs[key] = g
        return g


@dataclass
class _FrameGraph:
    hidden: torch.Tensor  # [B, H] static input
    packed: torch.Tensor  # [B, 2] int64 static input: slot, frame
    stop: torch.Tensor  # [B] bool output
    codes: torch.Tensor  # [B, n_vq] int64 output
    call: StaticCall | None = None  # body(hidden, slots, frames) -> (stop, codes), set once made


class FrameGraphs:
    """Per-batch-bucket CUDA graphs of the local loop + sampling alone, for the requests that
    complete their prompt in a prefill chunk (that backbone call runs eagerly):
    `body(hidden, slots, frames) -> (stop, codes)`; without `capture`, run eagerly on the bucket's
    static inputs."""

    def __init__(self, body, *, max_batch: int, hidden_size: int, dtype: torch.dtype, scratch_slot: int,
                 n_vq: int, pool, device: torch.device, capture: bool = True) -> None:
        self.body, self.max_batch, self.hidden_size, self.dtype = body, max_batch, hidden_size, dtype
        self.scratch_slot, self.n_vq, self.pool, self.device = scratch_slot, n_vq, pool, device
        self.capture = capture
        self._graphs: dict[int, _FrameGraph] = {}

    @property
    def keys(self) -> list[int]:
        """Batch buckets made so far."""
        return list(self._graphs)

    def capture_ahead(self, batches: list[int], budget_s: float | None = None,
                      progress: CaptureProgress | None = None) -> int:
        """Make the batch buckets of these sizes not made yet (every row on the scratch slot),
        largest first, stopping after `budget_s`; returns how many (each counted in `progress`)."""
        none = torch.zeros(0, self.hidden_size, dtype=self.dtype, device=self.device)
        return make_missing({batch_bucket(b, self.max_batch) for b in batches}, self._graphs,
                            lambda B: self.run(none, [], [], batch=B), budget_s, progress)

    def run(self, hidden: torch.Tensor, slots: list[int], frames: list[int],
            batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n, H] backbone states of the ready requests -> stop [n], codes [n, n_vq];
        `batch`: the bucket to use (default: the bucket of n)."""
        n = len(slots)
        B = batch_bucket(n, self.max_batch) if batch is None else batch
        packed = np.zeros((B, 2), dtype=np.int64)
        packed[:, 0] = self.scratch_slot
        packed[:n, 0], packed[:n, 1] = slots, frames
        g = self._graphs.get(B)
        if g is None:
            dev = self.device
            g = _FrameGraph(torch.zeros(B, self.hidden_size, dtype=self.dtype, device=dev),
                            torch.from_numpy(packed).to(dev), torch.empty(B, dtype=torch.bool, device=dev),
                            torch.empty(B, self.n_vq, dtype=torch.int64, device=dev))
            g.hidden[:n].copy_(hidden)
            g.call = StaticCall.first(lambda: self.body(g.hidden, g.packed[:, 0], g.packed[:, 1]), (g.stop, g.codes),
                                      capture=self.capture, pool=self.pool, device=dev)
            self._graphs[B] = g
        else:
            g.hidden[:n].copy_(hidden)
            g.hidden[n:].zero_()  # padding rows: finite inputs, results unread
            g.packed.copy_(torch.from_numpy(packed), non_blocking=True)
            g.call()
        return g.stop[:n], g.codes[:n]
