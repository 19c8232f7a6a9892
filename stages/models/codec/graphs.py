"""CUDA graphs of the codec's streaming decode, keyed by (batch bucket B, chunk length T frames).

`StreamingDecoder.decode(codes [n_vq, B, T], slots [B])` has fixed shapes for a given (B, T), and
everything it reads or updates is a device tensor indexed by slot: the ring KV caches
`[S, C, H, Dh]` and the per-slot frame counters `frames [S]` (positions, ring rows and the
visibility mask are computed on the device from `frames[slots]`; the only host-side values are
shapes). So a recorded call replays exactly what an eager call of the same shapes does, including
the state updates (`index_copy_` into the rings, the frame counters).

Keys: B = `bucket(n)` of n requests (powers of two up to 16, then multiples of 16, capped at
`max_batch`: a padding row of a 15-frame chunk costs as much as a real one), T <= `max_frames` (the
decoder's ring headroom; longer chunks are decoded in pieces by the caller). Rows may be shorter
than T: `valid` gives each row's real frames (`StreamingDecoder.decode`), so chunks of different
lengths share one replay. One graph per key is captured on first use (or ahead of time through
`capture`), all in one memory pool.

Padding is safe: rows n..B-1 carry slot `scratch_slot`, an extra decoder slot that no request ever
leases. They read and write only that slot's rings and counter (several padding rows race on the
same rows; the values are garbage nobody reads), and every op of the decode is row-wise (linears,
LayerNorm, per-row attention over the row's own slot, embedding lookups), so a padding row cannot
change a real row's output. The padding slots are rewritten before every call: a row that held a
real slot in a larger earlier call never replays it. Warm-up and capture run with every row on the
scratch slot (a decode advances `frames`, so it must not run on real slots twice), then the real
inputs are copied in and the graph replayed.

Eager mode (`use_cuda_graphs=False`) runs the same padded static inputs and scratch slot through
the decoder without recording, so CPU tests cover the bucket/padding/scratch logic.

Each `DecodeGraphs` warms up and records on a capture stream of its own. cuBLAS keeps its
workspace per (handle, stream) and a recording bakes in the workspace address of the stream it
was captured on: graphs captured on one stream share one workspace, so replaying two of them at
once (`CodecRunner`'s decode lanes, one `DecodeGraphs` each) would race on it.

Reference encoding never runs inside a capture, so its allocations stay in the default pool, not
the graphs' private one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from stages.models.codec.streaming import StreamingDecoder
from stages.runtime.graph_capture import CaptureProgress, make_missing

WARMUP_CALLS = 1  # eager calls on a side stream before recording (kernels, cuBLAS workspaces, allocator)


BUCKET_STEP = 16  # above this, batch buckets are multiples of it (below, powers of two)


def bucket(n: int, cap: int) -> int:
    """The batch bucket of n rows: the smallest power of two >= n up to `BUCKET_STEP`, else the
    smallest multiple of `BUCKET_STEP` >= n; at most cap (1 <= n <= cap)."""
    if not 1 <= n <= cap:
        raise ValueError(f"batch of {n} outside 1..{cap}")
    b = 1
    while b < n and b < BUCKET_STEP:
        b *= 2
    if b < n:
        b = -(-n // BUCKET_STEP) * BUCKET_STEP
    return min(b, cap)


def buckets(cap: int) -> list[int]:
    """Every batch bucket up to `cap`."""
    return sorted({bucket(n, cap) for n in range(1, cap + 1)})


@dataclass
class _Entry:
    codes: torch.Tensor  # [n_vq, B, T] int64 static input: a permuted view of a contiguous [B, T, n_vq]
    rows: torch.Tensor  # [3, B] int64 static input, one copy a call: `slots`, `valid`, `offset`
    out: torch.Tensor  # [B, channels, T * hop] fp32 static output: a view of the shared output buffer
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def slots(self) -> torch.Tensor:  # [B]; rows past the real requests hold the scratch slot
        return self.rows[0]

    @property
    def valid(self) -> torch.Tensor:  # [B] real frames of each row (T for padding rows)
        return self.rows[1]

    @property
    def offset(self) -> torch.Tensor:  # [B] frames before the row within its slot's chunk (0 for padding rows)
        return self.rows[2]


class DecodeGraphs:
    """Bucketed, padded replays of one `StreamingDecoder`'s `decode` (see the module docstring)."""

    def __init__(self, decoder: StreamingDecoder, *, n_vq: int, scratch_slot: int, max_batch: int,
                 use_cuda_graphs: bool, max_frames: int | None = None) -> None:
        if not 0 <= scratch_slot < decoder.num_slots:
            raise ValueError(f"scratch slot {scratch_slot} outside the decoder's {decoder.num_slots} slots")
        self.decoder = decoder
        self.n_vq, self.scratch_slot, self.max_batch = n_vq, scratch_slot, max_batch
        self.max_frames = decoder.max_chunk_frames if max_frames is None else min(max_frames, decoder.max_chunk_frames)
        self.device = decoder.frames.device
        if use_cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the decoder is on {self.device}")
        self.use_cuda_graphs = use_cuda_graphs
        self.pool = torch.cuda.graph_pool_handle() if use_cuda_graphs else None
        # warm-up and recording stream: its cuBLAS workspace is this instance's alone
        self.capture_stream = torch.cuda.Stream(self.device) if use_cuda_graphs else None
        cfg = decoder.model.cfg
        self.channels, self.hop = cfg.channels, cfg.downsample_rate
        self._out: torch.Tensor | None = None  # flat fp32, max_batch * channels * max_frames * hop, shared by all keys
        self._entries: dict[tuple[int, int], _Entry] = {}

    @property
    def keys(self) -> list[tuple[int, int]]:
        """(B, T) of the graphs captured (or, in eager mode, the static inputs made) so far."""
        return list(self._entries)

    def fits(self, n: int, frames: int) -> bool:
        """Whether a batch of n chunks of `frames` frames runs here (else: eager decode by the caller)."""
        return 1 <= n <= self.max_batch and 1 <= frames <= self.max_frames

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor | None = None,
               offset: torch.Tensor | None = None) -> torch.Tensor:
        """The next codes [n_vq, n, T] (host or device) of leased slots [n], row i real for its
        first valid[i] frames (default: all T) and starting offset[i] frames into its slot's chunk
        (default 0: a slot's pieces in one call, `StreamingDecoder.decode`) -> audio
        [n, channels, T * hop] on the device: a view of the static output, valid until the next
        call (row i's audio past valid[i] * hop is padding)."""
        nq, n, T = codes.shape
        if nq != self.n_vq or len(slots) != n or not self.fits(n, T):
            raise ValueError(f"codes {tuple(codes.shape)} / {len(slots)} slots do not fit the graphs "
                             f"(n_vq {self.n_vq}, batch <= {self.max_batch}, 1 <= T <= {self.max_frames})")
        B = bucket(n, self.max_batch)
        entry = self._entries.get((B, T)) or self._make(B, T)
        rows = torch.zeros((3, B), dtype=torch.long)  # [slots | valid | offset, B] host
        rows[0] = self.scratch_slot
        rows[0, :n] = slots.to("cpu", torch.long)
        rows[1] = T
        if valid is not None:
            rows[1, :n] = valid.to("cpu", torch.long)
        if offset is not None:
            rows[2, :n] = offset.to("cpu", torch.long)
        entry.rows.copy_(rows, non_blocking=True)
        entry.codes[:, :n].copy_(codes, non_blocking=True)  # padding rows keep earlier valid codes
        if entry.graph is not None:
            entry.graph.replay()
        else:
            self._body(entry)
        return entry.out[:n]

    def capture(self, batches: Iterable[int], chunk_lengths: Iterable[int], budget_s: float | None = None,
                progress: CaptureProgress | None = None) -> int:
        """Make the entries (record the graphs) of every (bucket(b), T) not made yet, largest first
        (later, smaller captures reuse the pool); stops after `budget_s`. Returns how many were made.
        Safe while requests hold slots: only the scratch slot is touched. Each is counted in
        `progress` (`graph_capture.make_missing`)."""
        keys = {(bucket(min(b, self.max_batch), self.max_batch), T) for b in batches for T in chunk_lengths
                if self.fits(min(b, self.max_batch), T)}
        return make_missing(keys, self._entries, lambda key: self._make(*key), budget_s, progress)

    def _body(self, entry: _Entry) -> None:
        entry.out.copy_(self.decoder.decode(entry.codes, entry.slots, entry.valid, entry.offset))

    def _make(self, B: int, T: int) -> _Entry:
        """Static inputs (all rows on the scratch slot, code 0) and, with CUDA graphs, the recording."""
        dev = self.device
        if self._out is None:
            self._out = torch.zeros(self.max_batch * self.channels * self.max_frames * self.hop,
                                    dtype=torch.float32, device=dev)
        codes = torch.zeros(B, T, self.n_vq, dtype=torch.long, device=dev).permute(2, 0, 1)  # [n_vq, B, T]
        rows = torch.zeros(3, B, dtype=torch.long, device=dev)
        rows[0], rows[1] = self.scratch_slot, T
        out = self._out[: B * self.channels * T * self.hop].view(B, self.channels, T * self.hop)
        entry = _Entry(codes, rows, out)
        if self.use_cuda_graphs:
            entry.graph = self._record(entry)
        self._entries[(B, T)] = entry
        return entry

    def _record(self, entry: _Entry) -> torch.cuda.CUDAGraph:
        """Warm up, then record into this instance's pool, both on its capture stream (all rows on
        the scratch slot)."""
        current = torch.cuda.current_stream(self.device)
        side = self.capture_stream
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                self._body(entry)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=side):
            self._body(entry)
        return graph
