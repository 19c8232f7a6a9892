"""CUDA graphs of the Realtime depth loop: backbone hidden states -> one frame of 16 codes.

The depth loop of a frame (16 positions through the local transformer, a head and `sample_tokens`
per codebook, the repetition history read and written) is thousands of small kernels: launch-bound
when run eagerly. Its shapes are fixed once the ready requests are padded to a batch bucket
(`graph_capture.batch_bucket`, as the backbone's), so one graph per bucket is recorded on first use (or ahead,
`capture_ahead`) and replayed afterwards. Everything the body reads is a device tensor: the static
inputs below (the hidden states copied in, one host-to-device copy of the packed slot columns per
call) and the runner's slot-indexed state (sampling settings, repetition history, forced-length
bans). Padding rows point at the runner's scratch slot: they read its settings and write its
history only.

Capture runs the body twice (a warm-up, then the recorded graph's first replay): the body must give
the same codes when re-run on the same inputs, which the runner's history ring guarantees
(`RealtimeRunner._depth`).

Without `capture` (any device; the CPU tests, graph path "eager") nothing is recorded: every call
copies its inputs into the same per-bucket static tensors and runs the same body on them eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from stages.runtime.graph_capture import CaptureProgress, StaticCall, batch_bucket, make_missing

# body(hidden [B, H], slots [B], frames [B], writes [B]) -> (codes [B, n_vq],)
DepthBody = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor]]


@dataclass
class _Graph:
    hidden: torch.Tensor  # [B, H] static input
    packed: torch.Tensor  # [B, 3] int64 static input: slot, frame, history slot written
    codes: torch.Tensor  # [B, n_vq] int64 static output
    call: StaticCall | None = None  # body over the static tensors, set once made


class DepthGraphs:
    """Per-batch-bucket graphs of the depth loop `body(hidden, slots, frames, writes) -> (codes,)`
    (without `capture`, the body run eagerly on the bucket's static inputs)."""

    def __init__(self, body: DepthBody, *, max_batch: int, hidden_size: int, dtype: torch.dtype, scratch_slot: int,
                 n_vq: int, device: torch.device, capture: bool = True) -> None:
        """`scratch_slot`: the request slot padding rows read and write."""
        self.body, self.max_batch, self.hidden_size, self.dtype = body, max_batch, hidden_size, dtype
        self.scratch_slot, self.n_vq, self.device, self.capture = scratch_slot, n_vq, device, capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # shared by every bucket
        self._graphs: dict[int, _Graph] = {}

    @property
    def keys(self) -> list[int]:
        """Batch buckets made so far."""
        return list(self._graphs)

    def capture_ahead(self, batches: list[int], budget_s: float | None = None,
                      progress: CaptureProgress | None = None) -> int:
        """Make the buckets of these batch sizes not made yet (every row a padding row), largest
        first, stopping after `budget_s`; returns how many (each counted in `progress`)."""
        none = torch.zeros(0, self.hidden_size, dtype=self.dtype, device=self.device)
        return make_missing({batch_bucket(b, self.max_batch) for b in batches}, self._graphs,
                            lambda B: self.run(none, [], [], [], batch=B), budget_s, progress)

    def run(self, hidden: torch.Tensor, slots: list[int], frames: list[int], writes: list[int],
            batch: int | None = None) -> torch.Tensor:
        """hidden [n, H] of the ready requests, their slots, frame indices and the history slot each
        writes -> codes [n, n_vq]: a view of the static output, valid until the next call.
        `batch`: the bucket to use (default: the bucket of n)."""
        n = len(slots)
        B = batch_bucket(n, self.max_batch) if batch is None else batch
        packed = np.zeros((B, 3), dtype=np.int64)  # padding rows: scratch slot, frame 0, scratch history
        packed[:, 0] = packed[:, 2] = self.scratch_slot
        packed[:n, 0], packed[:n, 1], packed[:n, 2] = slots, frames, writes
        g = self._graphs.get(B)
        if g is None:
            dev = self.device
            g = _Graph(torch.zeros(B, self.hidden_size, dtype=self.dtype, device=dev), torch.from_numpy(packed).to(dev),
                       torch.empty(B, self.n_vq, dtype=torch.int64, device=dev))
            g.hidden[:n].copy_(hidden)
            g.call = StaticCall.first(lambda: self.body(g.hidden, g.packed[:, 0], g.packed[:, 1], g.packed[:, 2]),
                                      (g.codes,), capture=self.capture, pool=self.pool, device=dev)
            self._graphs[B] = g
        else:
            g.hidden[:n].copy_(hidden)
            if n < B:
                g.hidden[n:].zero_()  # padding rows: finite inputs, results unread
            g.packed.copy_(torch.from_numpy(packed), non_blocking=True)
            g.call()
        return g.codes[:n]
