"""`CodecRunner` (docs/interfaces.md): streaming decode slots and batched reference encoding.

The codec worker owns one runner. A request leases a slot with `open(rid)`, feeds its code chunks
through `decode` in order, and frees the slot with `close(rid)`. Decoding a request's chunks one
after another equals decoding their concatenation at once (`stages.models.codec.streaming`).

With `cuda_graphs` (CUDA only) the chunks of one `decode` call of at most `max_chunk_frames` frames
are split by `stages.models.codec.dispatch_plan` into a few replays of graphs keyed by (batch bucket,
length T) from `stages.models.codec.graphs`, captured on first use or ahead through `capture`: each chunk
is padded to its replay's T with its real length as the row's valid frames, so its stream advances
by its real frames only; padding rows decode on a scratch slot (slot `max_slots`, never leased).
The replays' PCM comes back through one pinned host buffer and one wait per call. With
`decode_lanes` > 1 the replays of one call run on that many CUDA streams at once (replay i on lane
i mod lanes), each lane with its own graphs, memory pool and capture stream (so its own cuBLAS
workspace, `stages.models.codec.graphs`), the shared decoder state touched by
disjoint slots only (one chunk per request per call; the padding rows of every lane share the
scratch slot, whose values nobody reads): a replay of small chunks is bound by its thousands of
small kernels, not by the chip's throughput, so replays side by side fill the chip; a dispatch
planned into fewer calls than lanes is split (`dispatch_plan.spread`) so no lane idles. Longer chunks
(reference priming) replay in graph-sized pieces. With `split_chunks` a chunk may instead go into
a shorter replay as several rows of its slot, its pieces in order (`dispatch_plan.plan_pieces`;
the decoder's rings get one frame more of headroom, as a cut chunk's last row pads up to frame
16); not with lanes (two lanes would share the slot). Without graphs, chunks of equal length run as
one eager call. `graphs_eager` runs the same buckets, padding and scratch slot without recording
(CPU tests of that logic). With `encode_graphs` (CUDA only; `encode_graphs_eager` for CPU tests) reference
encoding replays graphs per (batch bucket, length bucket) from `stages.models.codec.encode_graphs`;
longer clips or larger batches encode eagerly.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from stages.models.codec.encode_graphs import EncodeGraphs
from stages.models.codec.dispatch_plan import CallCost, Piece, plan, plan_pieces, spread
from stages.models.codec.graphs import DecodeGraphs, bucket
from stages.models.codec.model import CodecModel
from stages.models.codec.streaming import StreamingDecoder
from stages.runtime.graph_capture import CaptureProgress


class SlotsExhausted(RuntimeError):
    """`open` found every streaming-decode slot leased."""


class CodecRunner:
    """Streaming decode and reference encoding with one MOSS-Audio-Tokenizer (v1 or v2).

    sample_rate, channels: of the PCM it returns; samples_per_frame: per channel (3840 for v2,
    1920 for v1); n_vq: codebooks per frame in and out (a prefix of the codec's quantizers).
    """

    def __init__(self, model: CodecModel, n_vq: int, max_slots: int,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 max_chunk_frames: int = 15, cuda_graphs: bool = False, graphs_eager: bool = False,
                 encode_graphs: bool = False, encode_graphs_eager: bool = False, encode_batch: int = 8,
                 encode_batch_samples: int | None = None,
                 decode_lanes: int = 1, split_chunks: bool = False, decode_alone: bool = False):
        """`decode_alone`: every chunk of a `decode` in a call of its own (one row, padded by its
        own length only), so its PCM does not depend on the chunks it was dispatched with: a
        batched call's matmuls see more rows and may pick kernels that round differently (the
        codec's side of `talker.batch_invariant`); not with `split_chunks` or `decode_lanes` > 1.
        `encode_batch_samples`: with encode graphs, only buckets of batch x length samples within
        it (`codec.encode_batch_seconds`)."""
        cfg = model.cfg
        if decode_lanes < 1:
            raise ValueError(f"decode_lanes must be >= 1, got {decode_lanes}")
        if split_chunks and decode_lanes > 1:  # a chunk's pieces share a slot: never on two lanes at once
            raise ValueError("split_chunks and decode_lanes > 1 do not go together")
        if decode_alone and (split_chunks or decode_lanes > 1):
            raise ValueError("decode_alone decodes one chunk a call: not with split_chunks or decode_lanes > 1")
        if not 1 <= n_vq <= cfg.quantizer.num_quantizers:
            raise ValueError(f"n_vq {n_vq} outside 1..{cfg.quantizer.num_quantizers} (the codec's quantizers)")
        if device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype)
            model.quantizer.float()
        self.model = model
        self.device = next(model.decoder.parameters()).device
        self.sample_rate = cfg.sampling_rate
        self.channels = cfg.channels
        self.samples_per_frame = cfg.downsample_rate
        self.n_vq = n_vq
        self.codebook_size = cfg.quantizer.codebook_size
        self.max_slots = max_slots
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, the codec is on {self.device}")
        padded = cuda_graphs or graphs_eager
        # one extra slot, `max_slots`, is the graphs' scratch slot for padding rows: never leased
        # cut chunks (`split_chunks`) reach up to a frame past the longest chunk: ceil(n / T) * T
        # <= 16 for n <= 15 and T a power of two (`plan_pieces` keeps every cut within it)
        self._decoder = StreamingDecoder(model, max_slots + 1 if padded else max_slots, max_chunk_frames,
                                         headroom_frames=max_chunk_frames + 1 if split_chunks else None)
        # lane 0 is `graphs`; each further lane has graphs (and a memory pool) of its own and a stream
        self.lanes = [DecodeGraphs(self._decoder, n_vq=n_vq, scratch_slot=max_slots, max_batch=max_slots,
                                   use_cuda_graphs=cuda_graphs) for _ in range(decode_lanes)] if padded else []
        self.graphs = self.lanes[0] if self.lanes else None
        self._lane_streams = [torch.cuda.Stream(self.device) for _ in self.lanes[1:]] if cuda_graphs else []
        if cuda_graphs and len({lane.capture_stream.cuda_stream for lane in self.lanes}) < len(self.lanes):
            raise ValueError(f"{decode_lanes} decode lanes need as many capture streams (cuBLAS "
                             f"workspaces); the stream pool gave fewer")
        if encode_graphs and self.device.type != "cuda":
            raise ValueError(f"encode_graphs needs a CUDA device, the codec is on {self.device}")
        self.encode_graphs = EncodeGraphs(model, n_vq=n_vq, max_batch=encode_batch, capture=encode_graphs,
                                          max_samples=encode_batch_samples) \
            if encode_graphs or encode_graphs_eager else None
        # replay lengths the planner may use: the graphs' longest and the powers of two below it
        # until `capture` names the schedule's lengths; the cost model until `calibrate`
        self.call_frames: tuple[int, ...] = ()
        if self.graphs is not None:
            m = self.graphs.max_frames
            self.call_frames = tuple(sorted({m} | {1 << i for i in range(m.bit_length()) if 1 << i < m}))
        self.call_cost = CallCost()
        self.split_chunks = split_chunks  # a chunk may go into a shorter replay as pieces (`plan_pieces`)
        self.decode_alone = decode_alone  # one chunk a call, whatever the dispatch holds
        self._host: torch.Tensor | None = None  # pinned on CUDA: the planned replays' PCM
        self.last_calls: list[tuple[int, int]] = []  # (rows, frames) of each call the last decode made
        self._slot_of: dict[int, int] = {}
        self._free = list(range(max_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def num_open(self) -> int:
        return len(self._slot_of)

    def open(self, rid: int) -> None:
        """Lease a fresh streaming-decode slot for request `rid`."""
        if rid in self._slot_of:
            raise ValueError(f"request {rid} already holds codec slot {self._slot_of[rid]}")
        if not self._free:
            raise SlotsExhausted(f"all {self.max_slots} codec slots are in use")
        slot = self._free.pop()
        self._decoder.reset(torch.tensor([slot]))
        self._slot_of[rid] = slot

    def close(self, rid: int) -> None:
        """Free `rid`'s slot; a no-op for a request without one (abort may race finish)."""
        slot = self._slot_of.pop(rid, None)
        if slot is not None:
            self._decoder.reset(torch.tensor([slot]))
            self._free.append(slot)

    def decode(self, items: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        """Next chunk of each request: (rid, codes [T, n_vq] int64) -> PCM float32 [channels, T * samples_per_frame].

        With graphs, chunks of up to the graphs' longest length go in as few replays as the
        modelled cost (`call_cost`, `stages.models.codec.dispatch_plan`) finds best, each chunk padded to
        its replay's length with its real length as the row's valid frames; the PCM arrays are
        then views of one pinned host buffer (on CUDA), valid until the next `decode`. Longer
        chunks (reference priming) replay in graph-sized pieces; without graphs, chunks of equal
        length decode in one eager call. With `decode_alone` each chunk is decoded as if it came
        alone (its PCM copied out of the host buffer before the next)."""
        rids = [rid for rid, _ in items]
        if len(set(rids)) != len(rids):
            raise ValueError(f"one decode call holds several chunks of one request: {rids}")
        for rid, codes in items:
            self._check_codes(rid, codes)
        if self.decode_alone and len(items) > 1:
            out, calls = [], []
            for item in items:
                out.append(np.array(self.decode([item])[0], copy=True))
                calls += self.last_calls
            self.last_calls = calls
            return out
        self.last_calls = []
        out: list[np.ndarray | None] = [None] * len(items)
        graphs = self.graphs
        short = [i for i, (_, codes) in enumerate(items)
                 if graphs is not None and 0 < codes.shape[0] <= graphs.max_frames]
        if short:
            self._decode_planned(items, short, out)
        groups: dict[int, list[int]] = {}
        for index, (_, codes) in enumerate(items):
            if out[index] is None:
                groups.setdefault(codes.shape[0], []).append(index)
        for frames, indices in groups.items():
            slots = torch.tensor([self._slot_of[items[i][0]] for i in indices])
            codes = torch.from_numpy(np.stack([items[i][1] for i in indices]))  # [B, T, n_vq]
            if graphs is not None and frames and len(indices) <= graphs.max_batch:
                audio = self._replay(codes, slots)
            else:
                codes = codes.to(self.device, non_blocking=True).permute(2, 0, 1)  # [n_vq, B, T]
                audio = self._decoder.decode(codes, slots).cpu().numpy()  # [B, channels, T * hop]
                self.last_calls.append((len(indices), frames))
            for row, i in enumerate(indices):
                out[i] = audio[row]
        return out  # type: ignore[return-value]

    def _decode_planned(self, items: list[tuple[int, np.ndarray]], indices: list[int],
                        out: list[np.ndarray | None]) -> None:
        """Chunks no longer than a graph through the planned replays; their PCM into `out`."""
        graphs = self.graphs
        lengths = [items[i][1].shape[0] for i in indices]
        batch = lambda n: bucket(n, graphs.max_batch)  # noqa: E731
        calls: list[tuple[int, list[Piece]]]
        if self.split_chunks:
            calls = plan_pieces(lengths, self.call_frames, batch, self.call_cost, graphs.max_batch,
                                self._decoder.headroom_frames)
        else:
            whole = plan(lengths, self.call_frames, batch, self.call_cost)
            if len(self.lanes) > 1:  # side by side: a dispatch takes its slowest lane's time
                whole = spread(whole, len(self.lanes), batch, self.call_cost)
            calls = [(T, [(m, 0, lengths[m]) for m in members]) for T, members in whole]
        host = self._host_views([(len(rows), T) for T, rows in calls])
        self.last_calls += [(len(rows), T) for T, rows in calls]
        main = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for stream in self._lane_streams[: len(calls) - 1]:
            stream.wait_stream(main)  # slot resets and earlier work first
        for k, ((T, rows), dst) in enumerate(zip(calls, host)):
            codes = np.zeros((len(rows), T, self.n_vq), dtype=np.int64)  # [n, T, n_vq], zero padding
            for row, (m, first, n) in enumerate(rows):
                codes[row, :n] = items[indices[m]][1][first: first + n]
            slots = torch.tensor([self._slot_of[items[indices[m]][0]] for m, _, _ in rows])
            valid = torch.tensor([n for _, _, n in rows])
            offset = torch.tensor([first for _, first, _ in rows])  # all 0 unless chunks were cut
            lane = k % len(self.lanes)
            with self._on_lane(lane):
                audio = self.lanes[lane].decode(torch.from_numpy(codes).permute(2, 0, 1), slots, valid,
                                                offset)  # [n, C, T * hop]
                dst.copy_(audio, non_blocking=True)
        if main is not None:
            for stream in self._lane_streams[: len(calls) - 1]:
                main.wait_stream(stream)
            main.synchronize()  # the dispatch's one wait
        hop = self.samples_per_frame
        parts: dict[int, list[np.ndarray]] = {}  # chunk -> its pieces' PCM, in order
        for (T, rows), dst in zip(calls, host):
            pcm = dst.numpy()
            for row, (m, _, n) in enumerate(rows):
                parts.setdefault(m, []).append(pcm[row, :, : n * hop])
        for m, pieces in parts.items():  # one piece: a view of the host buffer, no copy
            out[indices[m]] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=-1)

    def _on_lane(self, lane: int) -> Any:
        """The stream context of decode lane `lane` (lane 0 and CPU runners: the current stream)."""
        return torch.cuda.stream(self._lane_streams[lane - 1]) if lane and self._lane_streams else nullcontext()

    def _host_views(self, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Host tensors [n, channels, T * hop] for these (n, T), laid end to end in one buffer
        (pinned on CUDA, so the copies are asynchronous), grown when a dispatch needs more."""
        sizes = [n * self.channels * T * self.samples_per_frame for n, T in shapes]
        if self._host is None or self._host.numel() < sum(sizes):
            self._host = torch.empty(sum(sizes), dtype=torch.float32, pin_memory=self.device.type == "cuda")
        views, offset = [], 0
        for (n, T), size in zip(shapes, sizes):
            views.append(self._host[offset: offset + size].view(n, self.channels, T * self.samples_per_frame))
            offset += size
        return views

    def _replay(self, codes: torch.Tensor, slots: torch.Tensor) -> np.ndarray:
        """codes [n, T, n_vq] through the graphs, in pieces of at most their longest chunk (a stream's
        chunks decoded in turn equal their concatenation) -> PCM [n, channels, T * hop] on the host."""
        step = self.graphs.max_frames
        pieces = []
        for start in range(0, codes.shape[1], step):
            audio = self.graphs.decode(codes[:, start:start + step].permute(2, 0, 1), slots)  # a static view
            self.last_calls.append((codes.shape[0], min(step, codes.shape[1] - start)))
            pieces.append(audio.to("cpu", copy=True).numpy())  # one copy of the real rows (also on CPU)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=-1)

    def calibrate(self, iters: int = 3) -> CallCost | None:
        """Fit `call_cost` from timed decodes of three shapes on the scratch slot (graphs only;
        the shapes' graphs are made if missing): returns the new model, None without graphs."""
        graphs = self.graphs
        if graphs is None:
            return None
        wide = bucket(graphs.max_batch, graphs.max_batch)
        small = min(4, wide)
        if small == wide:
            return None
        shapes = [(small, 1), (wide, 1), (wide, graphs.max_frames)]
        timed = []
        for n, T in shapes:
            codes = torch.zeros(self.n_vq, n, T, dtype=torch.long)
            slots = torch.full((n,), graphs.scratch_slot, dtype=torch.long)
            graphs.decode(codes, slots)  # made and warm
            self._sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                graphs.decode(codes, slots)
            self._sync()
            timed.append((n, T, (time.perf_counter() - t0) * 1e3 / iters))
        self.call_cost = CallCost.fit(*timed)
        return self.call_cost

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture(self, batches: list[int] | tuple[int, ...], chunk_lengths: list[int] | tuple[int, ...],
                budget_s: float | None = None, progress: CaptureProgress | None = None) -> int:
        """Capture ahead the graphs of these batch sizes (their buckets) and chunk lengths, within
        `budget_s`; returns how many were captured (0 without graphs), each counted in `progress`.
        Open requests are untouched."""
        if self.graphs is None:
            return 0
        lengths = sorted({t for t in chunk_lengths if 1 <= t <= self.graphs.max_frames} | {self.graphs.max_frames})
        self.call_frames = tuple(lengths)
        deadline = None if budget_s is None else time.monotonic() + budget_s
        made = 0
        for lane in self.lanes:  # every lane the same keys: a call's replay may go to any of them
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            made += lane.capture(batches, lengths, left, progress)
        return made

    def capture_encode(self, budget_s: float | None = None, progress: CaptureProgress | None = None) -> int:
        """Capture ahead the reference-encoding graphs of every batch and length bucket, within
        `budget_s`; returns how many were made (0 without encode graphs), each counted in
        `progress`."""
        if self.encode_graphs is None:
            return 0
        return self.encode_graphs.capture_ahead(range(1, self.encode_graphs.max_batch + 1), budget_s, progress)

    def _check_codes(self, rid: int, codes: np.ndarray) -> None:
        if rid not in self._slot_of:
            raise KeyError(f"request {rid} has no codec slot (open it first)")
        if codes.ndim != 2 or codes.shape[1] != self.n_vq:
            raise ValueError(f"request {rid}: codes of shape {codes.shape}, expected [T, {self.n_vq}]")
        if codes.size and (codes.min() < 0 or codes.max() >= self.codebook_size):
            raise ValueError(f"request {rid}: codes outside [0, {self.codebook_size})")

    def encode(self, wavs: list[np.ndarray]) -> list[np.ndarray]:
        """Reference waveforms float32 [channels, samples] at sample_rate -> codes [T, n_vq] int64,
        T = samples // samples_per_frame (a trailing partial frame is dropped)."""
        for i, wav in enumerate(wavs):
            if wav.ndim != 2 or wav.shape[0] != self.channels:
                raise ValueError(f"waveform {i}: shape {wav.shape}, expected [{self.channels}, samples]")
        if not wavs:
            return []
        # eager, outside any graph capture: its allocations stay in the default pool, not the graphs'
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("encode called during a CUDA graph capture")
        longest = max(w.shape[1] for w in wavs)
        if longest < self.samples_per_frame:
            return [np.zeros((0, self.n_vq), dtype=np.int64) for _ in wavs]
        if self.encode_graphs is not None and self.encode_graphs.fits(len(wavs), longest):
            codes_dev, frames_dev = self.encode_graphs.encode([torch.from_numpy(w) for w in wavs])
            codes, frames = codes_dev.cpu().numpy(), frames_dev.cpu().numpy()  # [n_vq, B, T], [B]
            return [np.ascontiguousarray(codes[:, i, : frames[i]].T, dtype=np.int64) for i in range(len(wavs))]
        # the padded batch is made where it is encoded: each clip copied in, no padded host copy
        # (a batch of 32 references is ~100 MB of host memory to zero, fill and send otherwise)
        batch = torch.zeros((len(wavs), self.channels, longest), dtype=torch.float32, device=self.device)
        for i, wav in enumerate(wavs):
            batch[i, :, : wav.shape[1]].copy_(torch.from_numpy(np.ascontiguousarray(wav)))
        lengths = torch.tensor([w.shape[1] for w in wavs], device=self.device)
        result = self.model.encode(batch, lengths, self.n_vq)
        codes = result.codes.cpu().numpy()  # [n_vq, B, T]
        frames = result.lengths.cpu().numpy()
        return [np.ascontiguousarray(codes[:, i, : frames[i]].T, dtype=np.int64) for i in range(len(wavs))]
