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

`start_delay_tp` starts the group from the talker process (rank 0; the follower processes are
`stages.workers.tp_ranks` shells running `follow_rank`); its runner's `close()` also reaps them.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.models.delay.model import DelayModel
from stages.models.delay.runner import DelayRunner
from stages.runtime.attention.backends import ReferenceAttention, make_attention
from stages.runtime.attention.metadata import AttentionBackend, AttentionMetadata
from stages.runtime.row_scheduler import ScheduledBatch, default_num_blocks, make_paged_cache
from stages.runtime.tensor_parallel import TPGroup, destroy_tp
from stages.workers.tp_ranks import FollowerRanks, TPSpec, new_spec, start_followers

HOST = torch.device("cpu")
log = logging.getLogger(__name__)


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


def follow_rank(spec: TPSpec, rank: int, tp: TPGroup) -> int:
    """A follower process's work (`TPSpec.follower`): load this rank's shard, follow rank 0."""
    device = spec.devices[rank]
    model = DelayModel.from_dir(spec.model_dir, device=device, dtype=spec.torch_dtype, tp=tp)
    return follow(model, tp, attention=make_attention(spec.attention, device), **spec.options)


class LaunchedTPDelayRunner(TPDelayRunner):
    """Rank 0 of a group `start_delay_tp` started: `close()` also reaps the followers and leaves."""

    def __init__(self, model: DelayModel, tp: TPGroup, ranks: FollowerRanks, **options) -> None:
        super().__init__(model, tp, **options)
        self.ranks = ranks
        self.exit_codes: list[int] | None = None

    def _pack(self, scheduled) -> ScheduledBatch:
        """A step with a follower gone fails before it sends: the group cannot compute it, and a
        send to a dead peer may wait out the transport's timeout (minutes) rather than fail."""
        gone = self.ranks.gone()
        if gone:
            raise RuntimeError(f"tensor-parallel {', '.join(gone)} exited: the group is broken")
        return super()._pack(scheduled)

    def close(self) -> None:
        if self.exit_codes is not None:
            return
        try:
            gone = self.ranks.gone()
            if gone:  # the others cannot finish a collective call with it: stop() reaps them
                log.warning("tensor-parallel ranks not told to stop: %s exited", ", ".join(gone))
            else:
                super().close()
        except RuntimeError as exc:  # a follower went while being told (gloo: connection closed by peer)
            log.warning("tensor-parallel ranks could not be told to stop: %s", exc)
        finally:
            self.exit_codes = self.ranks.stop()
            destroy_tp()


def start_delay_tp(model_dir: str | Path, *, devices: list[str], dtype: torch.dtype = torch.float32,
                   max_running: int = 64, kv_block_size: int = 16, num_kv_blocks: int | None = None,
                   kv_memory_fraction: float = 0.5, torch_threads: int | None = None, attention: str = "auto",
                   **runner_options) -> LaunchedTPDelayRunner:
    """Rank 0's runner of a Delay talker split over `devices` (one rank each; this process is rank 0).

    attention: the backend every rank uses (`make_attention` name); runner_options: the other
    `DelayRunner` options (prefill sizes, finish rule). Steps run eagerly (no graphs under TP).
    """
    kv = dict(max_running=max_running, kv_block_size=kv_block_size, num_kv_blocks=num_kv_blocks,
              kv_memory_fraction=kv_memory_fraction)
    spec = new_spec(f"{__name__}:follow_rank", model_dir, devices, dtype, torch_threads=torch_threads,
                    attention=attention, **kv)
    ranks, tp = start_followers(spec)
    try:
        model = DelayModel.from_dir(model_dir, device=devices[0], dtype=dtype, tp=tp)
        return LaunchedTPDelayRunner(model, tp, ranks, attention=make_attention(attention, devices[0]),
                                     **kv, **runner_options)
    except BaseException:
        ranks.kill()
        destroy_tp()
        raise
