"""What every talker's decode graphs share: batch buckets, the packed static input of a decode
step (one new token per request over the paged KV cache), its attention metadata, and recording.

A decode step's shapes are fixed once its requests are padded to a bucket of B (requests) and
M (KV blocks per request; one fixed M up to `GRAPH_AHEAD_TOKENS` tokens when the attention reads
a block table only as far as its sequence's length, `table_bucket`): the host packs one int64 array `[B, 5 + M]` (slot, frame, position,
KV slot, sequence length, block table), copied to the device in one transfer, and the metadata
below are views of it. Padding rows point at a scratch request slot and a scratch KV block, so
they compute garbage nobody reads and write only there.

`graph_path` names how a runner runs its decode bodies: "off" (one eager call, no buckets),
"eager" (the same padded static inputs as the graphs, run eagerly: what CPU tests exercise) or
"cuda" (recorded CUDA graphs; falls back to "eager" off CUDA).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from stages.runtime.attention.metadata import AttentionMetadata

GRAPH_PATHS = ("off", "eager", "cuda")
K = TypeVar("K")  # a graph key (a bucket, or a tuple of them)


def resolve_graph_path(graph_path: str | None, cuda_graphs: bool, on_cuda: bool) -> str:
    """The graph path a runner uses: `graph_path` if given (None = "cuda" with `cuda_graphs`
    on a CUDA device, else "off"); "cuda" off CUDA becomes "eager" (capture needs CUDA)."""
    if graph_path is None:
        graph_path = "cuda" if cuda_graphs and on_cuda else "off"
    if graph_path not in GRAPH_PATHS:
        raise ValueError(f"graph_path {graph_path!r}: expected 'off', 'eager' or 'cuda'")
    return "eager" if graph_path == "cuda" and not on_cuda else graph_path


def bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most cap (cap itself when n > the largest power below it)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, cap) if n <= cap else n


GRAPH_AHEAD_TOKENS = 2048  # graphs are captured ahead for sequences up to this long


def table_bucket(blocks: int, max_blocks: int, width: int | None) -> int:
    """The block-table width M of a decode bucket whose longest table holds `blocks` blocks: the
    fixed `width` when one is set and the table fits it (an attention that reads a table only as
    far as its sequence's length, so the width costs nothing: one graph per batch bucket), else
    the power-of-two bucket (`bucket`)."""
    return width if width is not None and blocks <= width else bucket(blocks, max_blocks)


def powers_up_to(cap: int) -> list[int]:
    """1, 2, 4, ... below `cap`, then `cap`: every bucket of `bucket` up to it."""
    return [b for b in (1 << i for i in range(cap.bit_length())) if b < cap] + [cap]


BATCH_STEP = 32  # decode batch buckets: powers of two up to this, then its multiples


def batch_bucket(n: int, cap: int) -> int:
    """The decode batch bucket of n requests: a power of two up to `BATCH_STEP`, then a multiple of
    it (87 rows replay 96, not 128: a padding row costs a decode step as much as a real one),
    at most cap (cap itself when n is beyond the largest step below it)."""
    b = bucket(n, BATCH_STEP) if n <= BATCH_STEP else -(-n // BATCH_STEP) * BATCH_STEP
    return min(b, cap) if n <= cap else n


def batch_buckets(cap: int) -> list[int]:
    """Every `batch_bucket` up to `cap`, ascending."""
    return sorted({batch_bucket(n, cap) for n in range(1, cap + 1)})


def pack_decode_inputs(slots: list[int], frames: list[int], positions: list[int], slot_mapping: list[int],
                       seq_lens: list[int], tables: list[list[int]], *, batch: int, blocks: int,
                       scratch_slot: int, scratch_block: int, block_size: int) -> torch.Tensor:
    """The static graph input of a decode step, [batch, 5 + blocks] int64 on the host; rows past
    the real requests are padding that reads and writes only the scratch slot and block."""
    n = len(slots)
    packed = np.empty((batch, 5 + blocks), dtype=np.int64)
    packed[:, :5] = (scratch_slot, 0, 0, scratch_block * block_size, 1)
    packed[:, 5:] = scratch_block
    packed[:n, :5] = np.array([slots, frames, positions, slot_mapping, seq_lens], dtype=np.int64).T
    lengths = np.fromiter((len(t) for t in tables), dtype=np.int64, count=n)
    flat = np.fromiter((b for t in tables for b in t), dtype=np.int64, count=int(lengths.sum()))
    rows = np.repeat(np.arange(n), lengths)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    packed[rows, 5 + cols] = flat
    return torch.from_numpy(packed)


def decode_metadata(packed: torch.Tensor, block_size: int) -> AttentionMetadata:
    """Attention metadata of a packed decode step (`pack_decode_inputs`' layout, on the device):
    one token per row; every tensor is a view of `packed` or a constant of its shape, so a graph
    that reads them sees each replay's copy. The host lengths are upper bounds: only backends that
    read tensors (not `ReferenceAttention`) may run on it."""
    B, width = packed.shape
    M = width - 5
    dev = packed.device
    arange = torch.arange(B, device=dev)
    return AttentionMetadata(
        seq_ids=tuple(range(B)),
        query_start_loc=torch.arange(B + 1, device=dev, dtype=torch.int32),
        seq_lens=packed[:, 4],
        context_lens=packed[:, 4] - 1,
        block_tables=packed[:, 5:],
        slot_mapping=packed[:, 3],
        positions=packed[:, 2],
        last_token_index=arange,
        decode_rows=arange,
        decode_seqs=arange,
        prefill_seqs=arange[:0],
        prefill_rows=arange[:0, None],
        prefill_valid=torch.zeros(0, 1, dtype=torch.bool, device=dev),
        query_lens_host=(1,) * B,
        seq_lens_host=(M * block_size,) * B,  # upper bound; the graph path reads tensors only
        max_query_len=1,
        max_seq_len=M * block_size,
        every_row_attends=True,  # padding rows decode the scratch block: every row is a sequence's
    )


def sections(sizes: list[tuple[str, int]]) -> dict[str, slice]:
    """A flat static input laid out as consecutive sections: name -> slice, plus "size" (an
    empty slice at the end)."""
    out, offset = {}, 0
    for name, size in sizes:
        out[name] = slice(offset, offset + size)
        offset += size
    out["size"] = slice(offset, offset)
    return out


def run_eager(body, outputs: tuple[torch.Tensor, ...]) -> None:
    """Run `body` once without a graph, its results copied into the static `outputs`."""
    with torch.inference_mode():
        for out, result in zip(outputs, body()):
            out.copy_(result)


def record(body, outputs: tuple[torch.Tensor, ...], pool, device: torch.device) -> torch.cuda.CUDAGraph:
    """Warm `body` up on a side stream, release the allocator's cached blocks, record it (results
    copied into the static `outputs`) and replay it once, so the outputs hold this call's results."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        body()  # warm-up: allocator, cuBLAS workspaces, lazy init
    torch.cuda.current_stream(device).wait_stream(side)
    # the warm-up's freed blocks stay cached for its side stream; the capture's private pool cannot
    # use them, nor free cache while recording, so under a memory cap they would leave it short
    torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
        for out, result in zip(outputs, body()):
            out.copy_(result)
    graph.replay()
    return graph


class CaptureProgress:
    """The graphs one warm-up call records ahead (`what`, e.g. "talker: decode graphs"), counted
    and reported as they are made: a line at about every tenth of them or every `every_s`
    seconds, whichever comes first, then one for the whole (`finish`). The total is known before
    the first capture: `plan(call)` runs the capture call once with `make_missing` only counting
    what it would make. `report` takes each line (the worker's log)."""

    def __init__(self, what: str, report: Callable[[str], None], every_s: float = 10.0) -> None:
        self.what, self.report, self.every_s = what, report, every_s
        self.planning = False  # `make_missing` counts into `planned` instead of making
        self.planned = 0
        self.made = 0
        self._t0 = self._last_line = time.perf_counter()
        self._last_tenth = 0

    def plan(self, call: Callable[[CaptureProgress], object]) -> int:
        """Run `call(self)` (a runner's capture method given this progress) with nothing made:
        how many graphs it would make, which is then the total reported."""
        self.planning = True
        try:
            call(self)
        finally:
            self.planning = False
        self._t0 = self._last_line = time.perf_counter()
        return self.planned

    def count(self, n: int) -> None:
        """A capture call would make `n` graphs (while planning)."""
        self.planned += n

    def one_made(self) -> None:
        """A graph was made: a progress line when a tenth more of the total is done or `every_s`
        seconds have passed since the last line (the last graph waits for `finish`)."""
        self.made += 1
        now, total = time.perf_counter(), max(self.planned, self.made)
        tenth = 10 * self.made // total
        if self.made < total and (tenth > self._last_tenth or now - self._last_line >= self.every_s):
            self._last_tenth, self._last_line = tenth, now
            self.report(f"{self.what}: {self.made} of {total} ({100 * self.made // total}%), "
                        f"{now - self._t0:.1f} s")

    def finish(self) -> None:
        """The whole: how many of the planned graphs were made (fewer when the time budget ran
        out: the rest are recorded when serving first meets them) and in how long."""
        short = " (the time budget ran out: the rest when first needed)" if self.made < self.planned else ""
        self.report(f"{self.what}: captured {self.made} of {self.planned} in "
                    f"{time.perf_counter() - self._t0:.1f} s{short}")


def make_missing(keys: Iterable[K], made: Container[K], make: Callable[[K], object],
                 budget_s: float | None, progress: CaptureProgress | None = None) -> int:
    """`make(key)` for each of `keys` not in `made`, largest first (later, smaller captures reuse
    the pool's memory), stopping once `budget_s` has passed (None: no limit); how many were made.
    With `progress`, each one is counted there; while it plans, nothing is made (only counted)."""
    missing = sorted(set(keys) - set(made), reverse=True)
    if progress is not None and progress.planning:
        progress.count(len(missing))
        return 0
    deadline = None if budget_s is None else time.monotonic() + budget_s
    count = 0
    for key in missing:
        if deadline is not None and time.monotonic() > deadline:
            break
        make(key)
        count += 1
        if progress is not None:
            progress.one_made()
    return count


def replay_or_build(graphs: dict, key, host: torch.Tensor, build: Callable):
    """The graph of `key` run on `host` (a bucket's packed static input): `build(host, key)` makes,
    runs and stores it on first use; later calls copy `host` into its `packed` input and replay
    its `call`."""
    g = graphs.get(key)
    if g is None:
        return build(host, key)
    g.packed.copy_(host, non_blocking=True)
    g.call()
    return g


@dataclass
class StaticCall:
    """`body` over static inputs, its results copied into the static `outputs`; with a recorded
    `graph` a call replays it, without one (eager graph path, CPU tests) it runs `body` again."""

    body: Callable[[], tuple[torch.Tensor, ...]]
    outputs: tuple[torch.Tensor, ...]
    graph: torch.cuda.CUDAGraph | None = None

    @classmethod
    def first(cls, body, outputs: tuple[torch.Tensor, ...], *, capture: bool, pool, device: torch.device) -> StaticCall:
        """Run `body` once, recorded when `capture`: `outputs` hold this call's results."""
        if capture:
            return cls(body, outputs, record(body, outputs, pool, device))
        run_eager(body, outputs)
        return cls(body, outputs)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            run_eager(self.body, self.outputs)
