"""The Delay talker split over a tensor-parallel group: rank 0 serves, the other ranks follow.

Rank 0 is a `DelayRunner` (`TPDelayRunner`) over the rank-0 shard of the model: it owns the
scheduler, the block tables and the sampling. Each step it packs the batch on the host, sends
the backbone inputs (row ids `[N, 1 + n_vq]` and the attention metadata) to the other ranks with
one pickled broadcast over the gloo group (as numpy arrays, `step_wire`), and runs its part of the backbone; the followers
(`follow`) run theirs with the same inputs, so the two all-reduces per layer line up. Every rank's
hidden state is the full one after the final all-reduce, and only rank 0 applies the heads and
samples: output equals TP=1.

Every rank holds a KV pool of the same number of blocks (the smallest any rank can afford), with
its own KV heads: rank 0's block tables address all of them. `close()` tells the followers to
stop.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import numpy as np
import torch

from stages.runtime.attention.backends import ReferenceAttention
from stages.runtime.attention.metadata import AttentionBackend, AttentionMetadata
from stages.models.delay.model import DelayModel
from stages.runtime.row_scheduler import ScheduledBatch, default_num_blocks, make_paged_cache
from stages.models.delay.runner import DelayRunner
from stages.runtime.tensor_parallel import TPGroup

HOST = torch.device("cpu")


def meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """`meta` with every tensor on `device` (host copies and sizes unchanged)."""
    moved = {f.name: getattr(meta, f.name).to(device, non_blocking=True) for f in fields(meta)
             if isinstance(getattr(meta, f.name), torch.Tensor)}
    return replace(meta, **moved)


StepWire = tuple[np.ndarray, dict[str, Any]]  # ids [N, 1 + n_vq], AttentionMetadata fields


def step_wire(ids: torch.Tensor, meta: AttentionMetadata) -> StepWire:
    """Host step inputs as numpy arrays and plain values: they pickle ~25x faster than tensors
    (C=64 decode: ~0.4 ms against ~10 ms for the tensors, measured on this loaded CPU)."""
    values = {f.name: getattr(meta, f.name) for f in fields(meta)}
    return ids.numpy(), {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def from_step_wire(wire: StepWire, device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
    """`step_wire`'s inverse, with the tensors copied to `device`."""
    ids, values = wire
    meta = AttentionMetadata(**{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                                for k, v in values.items()})
    return torch.from_numpy(ids).to(device, non_blocking=True), meta_to(meta, device)


def agreed_num_blocks(model: DelayModel, tp: TPGroup, *, max_running: int, block_size: int = 16,
                      num_blocks: int | None = None, memory_fraction: float = 0.5) -> int:
    """KV blocks every rank can hold: the smallest of the ranks' own figures (a collective call)."""
    if num_blocks is None:
        param = next(model.parameters())
        num_blocks = default_num_blocks(model.language_model.rank_config, device=param.device, dtype=param.dtype,
                                        max_running=max_running, block_size=block_size,
                                        memory_fraction=memory_fraction)
    return tp.min_int(num_blocks)


class TPDelayRunner(DelayRunner):
    """Rank 0 of a tensor-parallel Delay talker: a `DelayRunner` that drives its follower ranks."""

    def __init__(self, model: DelayModel, tp: TPGroup, *, max_running: int = 64, kv_block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_memory_fraction: float = 0.5, **options) -> None:
        if tp.rank != 0:
            raise ValueError(f"TPDelayRunner runs on rank 0; rank {tp.rank} calls follow()")
        self.tp = tp
        self._closed = False
        blocks = agreed_num_blocks(model, tp, max_running=max_running, block_size=kv_block_size,
                                   num_blocks=num_kv_blocks, memory_fraction=kv_memory_fraction)
        super().__init__(model, max_running=max_running, kv_block_size=kv_block_size, num_kv_blocks=blocks, graph_path="off",
                         **options)

    def _pack(self, scheduled) -> ScheduledBatch:
        batch = self.scheduler.pack(scheduled, HOST)  # host tensors: picklable, no device sync
        self.tp.broadcast_object(step_wire(batch.ids, batch.meta))
        return replace(batch, ids=batch.ids.to(self.device, non_blocking=True),
                       meta=meta_to(batch.meta, self.device),
                       ready_rows=batch.ready_rows.to(self.device, non_blocking=True))

    def close(self) -> None:
        """Tell the followers to return (idempotent); the group itself stays for the caller to leave."""
        if not self._closed:
            self._closed = True
            self.tp.broadcast_object(None)


def follow(model: DelayModel, tp: TPGroup, *, max_running: int = 64, kv_block_size: int = 16,
           num_kv_blocks: int | None = None, kv_memory_fraction: float = 0.5,
           attention: AttentionBackend | None = None) -> int:
    """A follower rank: run the backbone on every step rank 0 sends until it closes; returns the steps run.

    The KV arguments must equal rank 0's (the block count is agreed with it here).
    """
    if tp.rank == 0:
        raise ValueError("rank 0 serves (TPDelayRunner); follow() is for the other ranks")
    blocks = agreed_num_blocks(model, tp, max_running=max_running, block_size=kv_block_size,
                               num_blocks=num_kv_blocks, memory_fraction=kv_memory_fraction)
    param = next(model.parameters())
    cache = make_paged_cache(model.language_model.rank_config, device=param.device, dtype=param.dtype,
                             max_running=max_running, block_size=kv_block_size, num_blocks=blocks)
    attention = attention or ReferenceAttention()
    device = cache.device
    steps = 0
    while (wire := tp.broadcast_object()) is not None:
        ids, meta = from_step_wire(wire, device)
        with torch.inference_mode():
            model(ids, meta, cache, attention)
        steps += 1
    return steps
