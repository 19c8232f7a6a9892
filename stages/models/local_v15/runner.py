"""Continuous-batching talker runner of Local-v1.5 (`TalkerRunner`, docs/interfaces.md).

One `step()`:
1. schedule (`stages.runtime.row_scheduler.RowScheduler`): every decoding request feeds its last frame's
   row (1 token); requests still in their prompt get prefill chunks (at most `prefill_chunk_tokens`
   each, `max_prefill_tokens_per_step` in all, admission order first) as far as free KV blocks
   allow, and while requests decode only on every `prefill_interval`-th step;
2. the backbone over the packed tokens and the paged KV cache;
3. the local loop (stop head + 12 codebooks) batched over every request whose prompt is now
   complete, sampled per request slot (`stages.runtime.sampling`: own seed, own frame counter, own
   repetition history);
4. one device-to-host copy of (stop, codes) of all those requests to build the `FrameEvent`s
   (in schedule order).

Without graphs (`graph_path="off"`), steps 2-3 are ONE backbone call over every scheduled token,
then one local loop. With graphs, a step is split in two parts whose results are concatenated
before step 4: the decoding requests (their row is the last frame's, held on the device in
`next_row`) replay the decode graph of their (batch, KV-blocks) bucket (backbone token + local
loop + sampling, `stages.models.local_v15.graphs.DecodeGraphs`); the prefill chunks (and any other row,
e.g. a prompt's last one) run one eager backbone call over their own rows only, and the requests
they complete replay the local loop from a graph per batch bucket (`FrameGraphs`). Decode rows
reserve their KV slots first, as in the one-call path. With `mixed_step_tokens`, a step that
decodes at least `MIXED_MIN_DECODE` requests and takes a few small prompt chunks replays one graph
for all of it instead (`stages.runtime.mixed_graphs`: the backbone over the decode rows and the
chunks' tokens, then the local loop over the decode rows and the completed prompts), so a prefill
step no longer pays a second backbone replay. `graph_path="cuda"` captures CUDA graphs
(`cuda_graphs=True` on a CUDA device); `"eager"` runs the same bodies on the same padded static
inputs without capture (what the CPU tests exercise; also the fallback of "cuda" off CUDA).

Request state that the model path reads (sampling settings, repetition history, the next input
row for graph replay) lives in slot-indexed device tensors; the host keeps the rows (prompt, then
one per frame), lengths and counters, so scheduling never waits on the device. When decoding
requests need KV blocks the pool does not have, the newest block holders (decoding or half
prefilled) are preempted: their blocks are freed and their prompt plus generated rows are
prefilled again later (recompute), which continues them exactly where they were.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from profiles import Profile
from speech.sampling import SamplingParams
from stages.models.local_v15.graphs import DecodeGraphs, FrameGraphs
from stages.models.local_v15.loader import load_talker
from stages.models.local_v15.model import LocalV15Talker
from stages.models.qwen3 import fuse_projections
from stages.runtime.attention.backends import PaddedBatchAttention
from stages.runtime.attention.metadata import AttentionBackend
from stages.runtime.fp8_linear import has_fp8_matmuls
from stages.runtime.graph_capture import (GRAPH_AHEAD_TOKENS, CaptureProgress, batch_bucket, batch_buckets, powers_up_to,
                                          resolve_graph_path)
from stages.runtime.mixed_graphs import MixedGraphs, MixedInputs
from stages.runtime.prefill_graphs import PrefillGraphs
from stages.runtime.row_scheduler import RowRequest
from stages.runtime.runner_options import resolve_dtype, talker_runner_options
from stages.runtime.sampling import K_CAP, SamplingSlots, noise_key, sample_tokens
from stages.runtime.scheduled_runner import ScheduledRunner, in_kernel_mode
from stages.runtime.step_clock import StepClock, StepTime
from stages.runtime.talker_runner import FrameEvent

log = logging.getLogger(__name__)

MIXED_MIN_DECODE = 16  # a mixed step decodes at least this many requests: below it the two
#                        replays are short anyway, and fewer decode buckets mean fewer graphs
MIXED_MAX_CHUNKS = 8  # prompt chunks a mixed step takes at most (under load: one or two a step)


@dataclass(slots=True, eq=False)
class _Request:
    sched: RowRequest  # rows: prompt, then [gen_slot, codes] per emitted frame
    params: SamplingParams
    frames: int = 0  # frames emitted

    @property
    def rid(self) -> int:
        return self.sched.rid

    @property
    def slot(self) -> int:
        return self.sched.slot

    @property
    def graph_decodable(self) -> bool:
        """Feeds one row that `next_row` holds: its last frame's (not a prompt row)."""
        return self.frames > 0 and self.sched.pending == 1


@dataclass(frozen=True, slots=True)
class SamplerMode:
    """Host-known facts about a step's requests that pick cheaper, exact sampling code (and so a
    graph of their own): `candidates` = every request keeps at most K_CAP tokens (1 <= top_k <=
    K_CAP, or greedy), so only its K_CAP best scores are ranked and hashed; `penalty` = some
    request has a repetition penalty != 1 (else the repetition history is not read)."""

    candidates: bool = False
    penalty: bool = True

    @classmethod
    def of(cls, params: list[SamplingParams]) -> SamplerMode:
        return cls(candidates=all(p.greedy or p.temperature <= 0 or 1 <= p.top_k <= K_CAP for p in params),
                   penalty=any(p.repetition_penalty != 1.0 for p in params))


class _SlotSampler:
    """`FrameSampler` over request slots: settings, repetition history and noise per request."""

    def __init__(self, runner: LocalV15Runner, slots: torch.Tensor, frames: torch.Tensor, mode: SamplerMode) -> None:
        self.slots, self.frames, self.n_vq, self.mode = slots, frames, runner.n_vq, mode
        self._fused = None  # `sample_tokens_fused` with `fused_sampling`
        if runner.fused_sampling:  # imports Triton: only when asked (its CPU interpreter must be chosen first)
            from stages.runtime.sampling_kernel import sample_tokens_fused

            self._fused = sample_tokens_fused
        self.seen = runner.seen
        self.audio = runner.sampling.rows(slots)
        self.text = runner.sampling.rows(slots, text=True)  # same seed as audio
        streams = torch.arange(runner.n_vq + 1, device=frames.device)
        self.keys = noise_key(self.audio.seed, frames, streams)  # [B, n_vq + 1]: every head's noise key

    def stop(self, logits: torch.Tensor) -> torch.Tensor:  # [B, 2] -> [B] bool
        key = self.keys[:, self.n_vq]
        if self._fused is not None:
            return self._fused(logits, self.text, key, width=K_CAP) == 1
        return sample_tokens(logits, self.text, self.frames, stream=self.n_vq, candidates=True, key=key) == 1

    def code(self, codebook: int, logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B]
        seen = self.seen[self.slots, codebook] if self.mode.penalty else None  # [B, V] bool
        key = self.keys[:, codebook]
        if self._fused is not None:
            return self._fused(logits, self.audio, key, seen, width=K_CAP if self.mode.candidates else None)
        return sample_tokens(logits, self.audio, self.frames, codebook, seen, candidates=self.mode.candidates, key=key)


class LocalV15Runner(ScheduledRunner):
    """The v1.5 talker with a paged KV cache, serving many requests at once."""

    def __init__(self, model: LocalV15Talker, *, cuda_graphs: bool = False, graph_path: str | None = None,
                 attention: AttentionBackend | None = None, prefill_graphs: bool = False,
                 overlap_steps: bool = False, mixed_step_tokens: int = 0, fused_sampling: bool = False,
                 **capacity) -> None:
        """`graph_path`: "off" | "eager" | "cuda" (module docstring); None = "cuda" with
        `cuda_graphs` on a CUDA device, else "off". `prefill_graphs`: with a graph path, prefill
        chunks replay `PrefillGraphs` too (else one eager call). `overlap_steps`: with a graph path
        (its decode rows are fed from the device), each `step()` launches a step and returns the
        events of the one before (`_step_ahead`). `mixed_step_tokens`: with a graph path and one
        block-table width (the Triton attention; any backend on the eager path), a step with at
        least `MIXED_MIN_DECODE` decode rows and at most `MIXED_MAX_CHUNKS` prompt chunks of this
        many tokens in all replays one mixed graph (module docstring); 0: off. `fused_sampling`:
        each head samples in one Triton kernel (`sampling_kernel.sample_tokens_fused`: the torch
        sampler's tokens but where rounding decides) instead of the torch sampler's chain of
        kernels. `capacity`:
        `ScheduledRunner`'s KV and batching settings (`prefill_interval` among them)."""
        cfg = model.config
        on_cuda = next(model.parameters()).device.type == "cuda"
        self.graph_path = graph_path = resolve_graph_path(graph_path, cuda_graphs, on_cuda)
        use_graphs = graph_path != "off"
        if use_graphs and not capacity.get("batch_invariant"):
            attention = attention or PaddedBatchAttention()  # reads tensors only: graph-capturable
        # with graphs, one extra slot and one extra block take the padding rows of a bucket
        extra = 1 if use_graphs else 0
        super().__init__(model, cfg.backbone, attention=attention, spare_kv_blocks=extra, **capacity)
        self.n_vq = cfg.n_vq
        max_running = self.max_running
        self.sampling = SamplingSlots(max_running + extra, self.device)
        self.seen = torch.zeros(max_running + extra, cfg.n_vq, cfg.codebook_size, dtype=torch.bool,
                                device=self.device)  # [slots, n_vq, codebook_size]: codes emitted so far
        self.next_row = torch.full((max_running + extra, 1 + cfg.n_vq), cfg.audio_pad_code, dtype=torch.long,
                                   device=self.device)  # [slots, 1 + n_vq]: the row each request feeds next
        self.mode = SamplerMode()  # this step's (set in step())
        self._graph_sets: dict[SamplerMode, tuple[DecodeGraphs, FrameGraphs]] = {}
        self._mixed_sets: dict[SamplerMode, MixedGraphs] = {}
        if use_graphs:
            # slot max_running and this block take the padding rows; every set shares one pool
            (self._scratch_block,) = self.cache.allocator.allocate(1)
            self.next_row[max_running, 0] = cfg.gen_slot
            self._capture = graph_path == "cuda"
            self._pool = torch.cuda.graph_pool_handle() if self._capture else None
        self._codebooks = torch.arange(cfg.n_vq, device=self.device)  # [n_vq]
        self.overlap_steps = overlap_steps and use_graphs  # decode rows must come from `next_row`
        self.fused_sampling = fused_sampling
        self._pending: _PendingStep | None = None  # the step launched and not read back yet
        self._clock: StepClock | None = None  # each step's GPU span and idle time (`time_steps`)
        self._ending: dict[int, _Request] = {}  # left at launch (forced length, cap), last events pending
        self._result_buffers: list[torch.Tensor] = []  # pinned, made on first use
        self._result_turn = 0
        self._requests: dict[int, _Request] = {}
        width = self.graph_table_width() or (self.cache.spec.blocks_for(GRAPH_AHEAD_TOKENS)
                                             if graph_path == "eager" else None)
        # (a backend that gathers whole tables pays for a wide one: mixed steps only on the eager path)
        self.mixed_step_tokens = mixed_step_tokens if use_graphs and width is not None else 0
        self._mixed_width = width
        self.prefill_graphs: PrefillGraphs | None = None
        if use_graphs and prefill_graphs:
            model_, cache, attention_ = self.model, self.cache, self.attention
            self.prefill_graphs = PrefillGraphs(
                lambda ids, meta: model_.transformer(model_.embed_rows(ids), meta, cache, attention_),
                width=1 + cfg.n_vq, hidden_size=cfg.hidden_size, dtype=self.dtype,
                max_tokens=self.max_prefill_tokens_per_step, max_seqs=self.prefill_graph_seqs,
                max_chunk=self.prefill_chunk_tokens, max_blocks=cache.spec.num_blocks - 1,
                scratch_block=self._scratch_block, block_size=cache.spec.block_size, device=self.device,
                capture=self._capture, pool=self._pool,
                table_width=self.graph_table_width())
            self.scheduler.max_prefill_chunks = self.prefill_graph_seqs  # a step's chunks fit one replay

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 **capacity) -> LocalV15Runner:
        return cls(load_talker(model_dir, device=device, dtype=dtype), **capacity)

    # ---- admission -----------------------------------------------------------------------------

    def add(self, rid: int, prompt: np.ndarray, params: SamplingParams) -> None:
        if rid in self._requests:
            raise ValueError(f"request {rid} is already running")
        prompt = self._checked_prompt(rid, prompt, params)
        sched = self.scheduler.add(rid, prompt)
        self._requests[rid] = _Request(sched, params)
        self.sampling.write(sched.slot, params)  # with its slot's resets, at the next launch (`_flush_slots`)

    @in_kernel_mode
    def capture_ahead(self, budget_s: float, progress: CaptureProgress | None = None) -> int:
        """Every graph serving can replay, made now (a capture while serving stalls every stream):
        for each sampler mode (those met so far first: the warm-up requests' at start-up), the
        decode graphs of every (batch, KV-blocks) bucket and the local-loop graphs of every batch
        bucket; then the
        prefill graphs of every token bucket (with `prefill_graphs`). Block tables of up to
        `GRAPH_AHEAD_TOKENS` tokens (longer ones are captured when met); largest first, within
        `budget_s`. Returns how many were made (0 without graphs), each counted in `progress`."""
        if self.graph_path == "off":
            return 0
        deadline = time.monotonic() + budget_s
        widest = self.cache.spec.blocks_for(GRAPH_AHEAD_TOKENS)
        made = 0
        every = [SamplerMode(candidates, penalty) for candidates in (True, False) for penalty in (False, True)]
        # (with one table width, `table_bucket` folds every width up to `widest` into it)
        for mode in list(self._graph_sets) + [m for m in every if m not in self._graph_sets]:
            decode, frame = self._graph_set(mode)
            made += decode.capture_ahead(batch_buckets(self.max_running), powers_up_to(min(widest, decode.max_blocks)),
                                         deadline - time.monotonic(), progress)
            made += frame.capture_ahead(batch_buckets(self.max_running), deadline - time.monotonic(), progress)
        g = self.prefill_graphs
        if g is not None:
            made += self.capture_prefill_graphs(deadline - time.monotonic(), progress)
        return made

    @in_kernel_mode
    def capture_decode_graphs(self, budget_s: float, progress: CaptureProgress | None = None) -> int:
        """With one table width (`graph_table_width`), the decode and local-loop graphs of every
        batch bucket for the sampler modes met so far (the warm-up requests'), and with
        `mixed_step_tokens` their mixed graphs of every decode bucket from `MIXED_MIN_DECODE` and
        token bucket, largest first, within `budget_s`; 0 when widths are bucketed. Returns how
        many were made, each counted in `progress`."""
        width = self.graph_table_width()
        if self.graph_path == "off" or width is None:
            return 0
        deadline = time.monotonic() + budget_s
        made = 0
        for mode, (decode, frame) in list(self._graph_sets.items()):
            made += decode.capture_ahead(batch_buckets(self.max_running), [width], deadline - time.monotonic(),
                                         progress)
            made += frame.capture_ahead(batch_buckets(self.max_running), deadline - time.monotonic(), progress)
            if self.mixed_step_tokens:
                mixed = self._mixed_graphs(mode)
                made += mixed.capture_ahead([b for b in batch_buckets(self.max_running) if b >= MIXED_MIN_DECODE],
                                            mixed.token_buckets(), deadline - time.monotonic(), progress)
        return made

    @in_kernel_mode
    def capture_prefill_graphs(self, budget_s: float, progress: CaptureProgress | None = None) -> int:
        """The prefill graphs of every token bucket (and block-table bucket up to
        `GRAPH_AHEAD_TOKENS` tokens, when widths are bucketed), within `budget_s`: how many were
        made (0 without prefill graphs), each counted in `progress`."""
        g = self.prefill_graphs
        if g is None:
            return 0
        widest = self.cache.spec.blocks_for(GRAPH_AHEAD_TOKENS)
        return g.capture_ahead(g.token_buckets(), powers_up_to(min(widest, g.max_blocks)), budget_s, progress)

    # ---- one step ------------------------------------------------------------------------------

    def time_steps(self, on: bool = True) -> None:
        """Time each step on the GPU (CUDA only; `take_step_times`): two timing events a step,
        for a timeline."""
        self._clock = StepClock() if on and self.device.type == "cuda" else None

    def take_step_times(self) -> list[StepTime]:
        """Each step read back since the last call as the GPU timed it, with its decode rows and
        prompt tokens; empty unless `time_steps`."""
        return self._clock.take() if self._clock is not None else []

    @in_kernel_mode
    def step(self) -> list[FrameEvent]:
        """One scheduler step's frames. With `overlap_steps` the events are those of the step
        launched by the previous call (`_step_ahead`)."""
        if self.overlap_steps:
            return self._step_ahead()
        if not self._requests:
            return []
        start = self._clock.mark() if self._clock is not None else None
        launched = self._launch()
        if launched is None:
            return []
        ready, stop, codes, order = launched
        out = self._finish_device(ready, stop, codes)
        end = self._clock.mark() if start is not None else None
        out = out.cpu().numpy()  # the step's one host copy
        if start is not None:
            self._clock.finished(start, end, self.scheduler.last_batch)
        return self._finish_host(ready, out, order)

    def _launch(self):
        """Schedule a step and enqueue its device work: (ready, stop [B], codes [B, n_vq], order of
        the events), or None when no request completes a row."""
        self._flush_slots()
        scheduled = self.scheduler.schedule()
        self.mode = SamplerMode.of([self._requests[r.rid].params for r, _ in scheduled])
        if self.graph_path == "off":
            parts = [self._eager_part(scheduled)]
        else:
            graph_rows = [self._requests[r.rid].graph_decodable for r, _ in scheduled]  # before any pack
            decode = [self._requests[r.rid] for (r, _), g in zip(scheduled, graph_rows) if g]
            chunks = [item for item, g in zip(scheduled, graph_rows) if not g]
            if self._mixes(decode, chunks):
                parts = [self._mixed_part(decode, chunks)]
            else:
                parts = [self._graph_decode(decode) if decode else None, self._eager_part(chunks) if chunks else None]
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        ready = [r for p in parts for r in p[0]]
        if len(parts) == 1:
            stop, codes = parts[0][1:]
        else:
            stop, codes = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])  # [B], [B, n_vq]
        position = {r.rid: i for i, (r, _) in enumerate(scheduled)}
        order = sorted(range(len(ready)), key=lambda i: position[ready[i].rid])  # events in schedule order
        return ready, stop, codes, order

    def _flush_slots(self) -> None:
        """The slots of the requests added since the last launch take their sampling settings, an
        empty repetition history and the generation slot as the first row they feed: a dozen
        kernels for however many came (a first wave of 96 cost ~35 ms of the talker's host time
        with a dozen kernels each)."""
        slots = self.sampling.flush()  # [n] on the device, or None
        if slots is not None:
            self.seen.index_fill_(0, slots, False)
            self.next_row[:, 0].index_fill_(0, slots, self.model.config.gen_slot)

    # ---- one step ahead (`overlap_steps`) --------------------------------------------------------

    def _step_ahead(self) -> list[FrameEvent]:
        """Launch the next step, then read back and turn into events the one launched before,
        so the host's work of a step (scheduling, packing, events) runs while the GPU computes
        the previous one. The next step is planned before the last one's results are known:
        every request that made a frame feeds a placeholder row (its real row is on the device,
        `next_row`; the placeholder is filled when the results come), a request whose stop head
        fired is computed once more and that frame dropped, and a step that would preempt waits
        for the results first (a recompute prefills the host rows)."""
        pending, self._pending = self._pending, None
        events: list[FrameEvent] = []
        if pending is not None and self._preempts_next():
            events += self._complete(pending)
            pending = None
        launched = None
        if self._requests:
            start = self._clock.mark() if self._clock is not None else None
            step = self._launch()
            if step is not None:
                launched = self._enqueue_results(*step)
                if start is not None:
                    launched.marks = (start, self._clock.mark(), self.scheduler.last_batch)
        if pending is not None:
            events += self._complete(pending)
        self._pending = launched
        return events

    def _preempts_next(self) -> bool:
        """Whether the next schedule would preempt (its decoders need more blocks than are free)."""
        cache = self.cache
        need = sum(cache.blocks_needed(r.rid, 1) for r in self.scheduler.requests.values() if r.pending == 1)
        return need > cache.num_free_blocks

    def _enqueue_results(self, ready: list[_Request], stop: torch.Tensor, codes: torch.Tensor,
                         order: list[int]) -> _PendingStep:
        """The device part of finishing a step and an asynchronous copy of its results; on the
        host, what is known now: each ready request's frame count and a placeholder row, and the
        requests whose forced length or frame cap ends them here leave the runner now."""
        out = self._finish_device(ready, stop, codes)  # [B, 1 + n_vq]
        event = None
        if out.device.type == "cuda":
            host = self._result_buffer(len(ready))
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            out = host
        placeholder = np.full(1 + self.n_vq, self.model.config.audio_pad_code, dtype=np.int64)
        placeholder[0] = self.model.config.gen_slot
        rows, ended = [], {}
        for r in ready:
            r.sched.rows.append(placeholder)
            rows.append(len(r.sched.rows) - 1)
            r.frames += 1
            reason = _host_finish(r)
            if reason is not None:
                ended[r.rid] = reason
                self.remove(r.rid)
                self._ending[r.rid] = r  # its frames of earlier steps still come out
        return _PendingStep(ready, out, event, rows, order, ended)

    def _result_buffer(self, n: int) -> torch.Tensor:
        """A pinned host buffer for a step's results [n, 1 + n_vq] (two, used in turn: one step's
        results may still be unread when the next step's copy is enqueued)."""
        if not self._result_buffers:
            shape = (self.max_running + 1, 1 + self.n_vq)
            self._result_buffers = [torch.empty(shape, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._result_turn ^= 1
        return self._result_buffers[self._result_turn][:n]

    def _complete(self, pending: _PendingStep) -> list[FrameEvent]:
        """The events of a launched step, once its results are on the host."""
        if pending.event is not None:
            pending.event.synchronize()
        if pending.marks is not None:
            self._clock.finished(*pending.marks)
        out = pending.out.numpy() if isinstance(pending.out, torch.Tensor) else pending.out
        events = []
        for i in pending.order:
            r, row = pending.ready[i], out[i]
            running = self._requests.get(r.rid) is r
            if not running and self._ending.get(r.rid) is not r:
                continue  # finished or aborted since this step was launched: its frame is dropped
            ended = pending.ended.get(r.rid)
            if ended is not None or row[0]:
                self._ending.pop(r.rid, None)  # its last event: later steps' frames are dropped
            if row[0]:
                events.append(FrameEvent(r.rid, None, finished=True, reason="stop"))
                if running:
                    self.remove(r.rid)
                continue
            codes_r = row[1:].copy()
            r.sched.rows.view()[pending.rows[i]] = (self.model.config.gen_slot, *codes_r)
            events.append(FrameEvent(r.rid, codes_r, finished=ended is not None, reason=ended))
        return events

    def _eager_part(self, chunks: list[tuple[RowRequest, int]]):
        """One backbone call over `chunks` (a prefill-graph replay when they fit one, else eager),
        then the local loop of the requests it completes: (ready, stop [B], codes [B, n_vq]), or
        None when none completes."""
        blocks_for = self.cache.spec.blocks_for
        if self.prefill_graphs is not None and self.prefill_graphs.fits(
                [n for _, n in chunks], [blocks_for(r.prefilled + n) for r, n in chunks]):
            packed, done, index = self.scheduler.reserve(chunks)
            with torch.inference_mode():
                hidden, last = self.prefill_graphs.run(packed)  # [T, H], [len(chunks)]
                rows = last[torch.tensor(index, dtype=torch.long).to(self.device, non_blocking=True)]
        else:
            batch = self.scheduler.pack(chunks, self.device)
            with torch.inference_mode():
                hidden = self.model.transformer(self.model.embed_rows(batch.ids), batch.meta, self.cache,
                                                self.attention)  # [N, H]
            done, rows = batch.ready, batch.ready_rows
        if not done:
            return None
        ready = [self._requests[r.rid] for r in done]
        h = hidden[rows]  # [B, H]
        if self.frame_graphs is not None:
            stop, codes = self.frame_graphs.run(h, [r.slot for r in ready], [r.frames for r in ready])
            return ready, stop, codes
        dev = self.device
        slots = torch.tensor([r.slot for r in ready]).to(dev, non_blocking=True)  # [B]
        frames = torch.tensor([r.frames for r in ready]).to(dev, non_blocking=True)  # [B]
        with torch.inference_mode():
            stop, codes = self._frame_body(h, slots, frames, self.mode)  # [B], [B, n_vq]
        return ready, stop, codes

    # ---- graphs, one set per sampler mode ------------------------------------------------------

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode graphs of this step's sampler mode (None without graphs)."""
        return self._graph_set()[0] if self.graph_path != "off" else None

    @property
    def frame_graphs(self) -> FrameGraphs | None:
        """The local-loop graphs of this step's sampler mode (None without graphs)."""
        return self._graph_set()[1] if self.graph_path != "off" else None

    def _graph_set(self, mode: SamplerMode | None = None) -> tuple[DecodeGraphs, FrameGraphs]:
        """The graphs of `mode` (default: this step's), made empty on first use."""
        mode = self.mode if mode is None else mode
        found = self._graph_sets.get(mode)
        if found is None:
            n_vq, scratch = self.model.config.n_vq, self.max_running  # the padding rows' slot
            decode = DecodeGraphs(lambda slots, frames, meta: self._decode_body(slots, frames, meta, mode),
                                  max_batch=scratch, max_blocks=self.cache.spec.num_blocks - 1,
                                  scratch_slot=scratch, scratch_block=self._scratch_block,
                                  block_size=self.cache.spec.block_size, n_vq=n_vq, device=self.device,
                                  capture=self._capture, pool=self._pool, table_width=self.graph_table_width())
            frame = FrameGraphs(lambda h, slots, frames: self._frame_body(h, slots, frames, mode),
                                max_batch=scratch, hidden_size=self.model.config.hidden_size, dtype=self.dtype,
                                scratch_slot=scratch, n_vq=n_vq, pool=self._pool, device=self.device,
                                capture=self._capture)
            found = self._graph_sets[mode] = (decode, frame)
        return found

    def _frame_body(self, h: torch.Tensor, slots: torch.Tensor, frames: torch.Tensor, mode: SamplerMode):
        """The local loop + sampling of a frame (what `FrameGraphs` records)."""
        return self.model.decode_frame(h, _SlotSampler(self, slots, frames, mode))

    def _decode_body(self, slots: torch.Tensor, frames: torch.Tensor, meta,
                     mode: SamplerMode) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-only step as pure device work (what `DecodeGraphs` records)."""
        hidden = self.model.transformer(self.model.embed_rows(self.next_row[slots]), meta, self.cache,
                                        self.attention)  # [B, H]: one new token per request
        return self.model.decode_frame(hidden, _SlotSampler(self, slots, frames, mode))

    def _reserve_decode(self, decode: list[_Request]) -> tuple[list[int], list[int]]:
        """One KV slot for each decoding request's row (counted as prefilled): their positions
        and KV slots."""
        positions, kv_slots = [], []
        for r in decode:
            start, (slot,) = self.cache.append_slots(r.rid, 1)
            r.sched.prefilled += 1
            positions.append(start)
            kv_slots.append(slot)
        return positions, kv_slots

    def _graph_decode(self, decode: list[_Request]):
        """Reserve one KV slot per decoding request and replay its bucket's decode graph:
        (decode, stop [B], codes [B, n_vq])."""
        cache = self.cache
        positions, kv_slots = self._reserve_decode(decode)
        packed, key = self.graphs.pack([r.slot for r in decode], [r.frames for r in decode], positions, kv_slots,
                                       [p + 1 for p in positions], [cache.block_table(r.rid) for r in decode])
        stop, codes = self.graphs.run(packed, key, len(decode))
        return decode, stop, codes

    # ---- mixed steps (`mixed_step_tokens`) -------------------------------------------------------

    def graph_sets(self) -> list[Any]:
        """The backbone's sets, then each sampler mode's decode, local-loop and mixed graphs."""
        sets = super().graph_sets()
        for decode, frame in self._graph_sets.values():
            sets += [decode, frame]
        return sets + list(self._mixed_sets.values())

    def _mixed_graphs(self, mode: SamplerMode | None = None) -> MixedGraphs:
        """The mixed graphs of `mode` (default: this step's), made empty on first use."""
        mode = self.mode if mode is None else mode
        found = self._mixed_sets.get(mode)
        if found is None:
            n_vq, scratch, dev = self.model.config.n_vq, self.max_running, self.device
            found = self._mixed_sets[mode] = MixedGraphs(
                lambda inputs: self._mixed_body(inputs, mode),
                lambda rows: (torch.empty(rows, dtype=torch.bool, device=dev),
                              torch.empty(rows, n_vq, dtype=torch.int64, device=dev)),
                width=1 + n_vq, max_batch=scratch, max_tokens=self.mixed_step_tokens,
                max_seqs=MIXED_MAX_CHUNKS, table_width=self._mixed_width, scratch_slot=scratch,
                scratch_block=self._scratch_block, block_size=self.cache.spec.block_size, device=dev,
                capture=self._capture, pool=self._pool)
        return found

    def _mixes(self, decode: list[_Request], chunks: list[tuple[RowRequest, int]]) -> bool:
        """Whether this step's decode rows and chunks run as one mixed replay."""
        if not self.mixed_step_tokens or len(decode) < MIXED_MIN_DECODE or not chunks:
            return False
        blocks_for = self.cache.spec.blocks_for
        return self._mixed_graphs().fits(
            len(decode), [n for _, n in chunks],
            [blocks_for(r.sched.prefilled + 1) for r in decode] + [blocks_for(r.prefilled + n) for r, n in chunks])

    def _mixed_body(self, x: MixedInputs, mode: SamplerMode) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixed step as pure device work (what `MixedGraphs` records): the backbone over the
        decode rows (their next rows, by slot) and the chunks' tokens, then the local loop over the
        sampled rows (decode rows, each chunk's last token)."""
        ids = torch.cat([self.next_row[x.dec_slots], x.ids])  # [B + T, 1 + n_vq]
        hidden = self.model.transformer(self.model.embed_rows(ids), x.meta, self.cache, self.attention)  # [B + T, H]
        return self.model.decode_frame(hidden[x.rows], _SlotSampler(self, x.slots, x.frames, mode))

    def _mixed_part(self, decode: list[_Request], chunks: list[tuple[RowRequest, int]]):
        """Reserve the decode rows' KV slots, then the chunks', and replay one mixed graph:
        (ready: the decode requests, then those the chunks complete; stop [B], codes [B, n_vq])."""
        cache = self.cache
        positions, kv_slots = self._reserve_decode(decode)
        tables = [cache.block_table(r.rid) for r in decode]
        packed, done, index = self.scheduler.reserve(chunks)
        completed = [self._requests[r.rid] for r in done]
        marks: list[tuple[int, int] | None] = [None] * len(chunks)
        for i, r in zip(index, completed):
            marks[i] = (r.slot, r.frames)
        mixed = self._mixed_graphs()
        with torch.inference_mode():
            stop, codes = mixed.run([r.slot for r in decode], [r.frames for r in decode], positions, kv_slots,
                                    tables, packed, marks)  # rows [B + MIXED_MAX_CHUNKS]
            B = batch_bucket(len(decode), mixed.max_batch)
            pick = torch.tensor([*range(len(decode)), *(B + i for i in index)]).to(self.device, non_blocking=True)
            return decode + completed, stop[pick], codes[pick]

    def _finish_device(self, ready: list[_Request], stop: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Apply forced lengths and record the frame in the requests' device state (repetition
        history, the row each feeds next): the step's results [B, 1 + n_vq] (stop, codes) on the
        device; stop [B], codes [B, n_vq] are `ready`'s."""
        dev = self.device
        slots = torch.tensor([r.slot for r in ready]).to(dev, non_blocking=True)  # [B]
        forced = [r.params.forced_frames for r in ready]
        model_decides = torch.tensor([f is None for f in forced]).to(dev, non_blocking=True)  # [B]
        forced_stop = torch.tensor([f is not None and r.frames >= f for f, r in zip(forced, ready)])
        forced_stop = forced_stop.to(dev, non_blocking=True)  # [B] (a blocking copy would wait for the step)
        with torch.inference_mode():
            stop = torch.where(model_decides, stop, forced_stop)
            self.seen.index_put_((slots[:, None], self._codebooks[None, :], codes), self._true)
            self.next_row[slots, 1:] = codes
            return torch.cat([stop[:, None].long(), codes], dim=1)

    def _finish_host(self, ready: list[_Request], out: np.ndarray, order: list[int]) -> list[FrameEvent]:
        """Record each ready request's frame on the host and build the events (in `order` of
        `ready`) from the step's results `out` [B, 1 + n_vq]."""
        events = []
        for i in order:
            r, row = ready[i], out[i]
            if row[0]:
                events.append(FrameEvent(r.rid, None, finished=True, reason="stop"))
                self.remove(r.rid)
                continue
            codes_r = row[1:].copy()
            r.frames += 1
            row[0] = self.model.config.gen_slot
            r.sched.rows.append(row)  # the row it feeds next
            reason = _host_finish(r)
            events.append(FrameEvent(r.rid, codes_r, finished=reason is not None, reason=reason))
            if reason is not None:
                self.remove(r.rid)
        return events


@dataclass(slots=True)
class _PendingStep:
    """A launched step whose results are not read yet (`overlap_steps`)."""

    ready: list[_Request]  # the requests it makes a frame (or a stop) for
    out: torch.Tensor  # [B, 1 + n_vq] int64 results: stop, codes (pinned host buffer, or on the CPU)
    event: torch.cuda.Event | None  # recorded after the copy (None on the CPU)
    rows: list[int]  # each ready request's placeholder row index
    order: list[int]  # events in schedule order
    ended: dict[int, str]  # rid -> finish reason known at launch (forced length, frame cap)
    # its start and end, and its (decode rows, prefill tokens) (`time_steps`)
    marks: tuple[torch.cuda.Event, torch.cuda.Event, tuple[int, int]] | None = None


def _host_finish(r: _Request) -> str | None:
    """The finish a request's frame count decides on the host: "stop" at its forced length,
    "length" at its frame cap, else None."""
    if r.params.forced_frames is not None and r.frames >= r.params.forced_frames:
        return "stop"
    if r.frames >= r.params.max_new_frames:
        return "length"
    return None


def load_served_model(model_dir: str | Path, profile: Profile, device: str) -> LocalV15Talker:
    """The talker as a profile serves it: `model.dtype`, torch.compile (CUDA only; not with
    `talker.batch_invariant`: a compiled graph picks its own reduction kernels and is specialised
    for a batch of one), the local steps' attention (`talker.local_attention`), the backbone's fused projections
    (`talker.fused_projections`) and KV stores (`talker.fused_kv_writes`, or with the q/k norms and
    RoPE in one kernel: `talker.fused_qk_rope_store`, and the residual sums deferred:
    `talker.deferred_residuals`) and float8 weights
    (`talker.fp8_weights` by `talker.fp8_scheme`, after the projections are fused; on a device
    without float8 matmuls, before sm89, the weights stay as loaded, with a warning), their MLPs'
    SiLU product quantized by one kernel (`talker.fp8_fused_swiglu`) and their products' scales
    applied by the kernels after them (`talker.fp8_fused_scales`), their sums, norms and rows'
    quantization in one kernel each (`talker.fp8_fused_norms`)."""
    model = load_talker(model_dir, device=device, dtype=resolve_dtype(profile.model.dtype, device))
    if profile.talker.local_attention == "plain":  # never with batch_invariant (the profile's checks)
        model.local_transformer.attend_plainly()
    elif profile.talker.local_attention == "kernel":
        model.local_transformer.attend_by_kernel()
    if profile.talker.fused_projections:
        fuse_projections(model.transformer)
    fp8 = profile.talker.fp8_weights
    if fp8 != "none" and not has_fp8_matmuls(device):
        log.warning("talker.fp8_weights %s: %s has no float8 matmuls (CUDA sm89 and later); "
                    "serving %s weights", fp8, device, profile.model.dtype)
        fp8 = "none"
    model.use_fp8_weights(fp8, profile.talker.fp8_scheme)
    model.transformer.use_fp8_swiglu(profile.talker.fp8_fused_swiglu)
    model.transformer.store_kv_in_layers(profile.talker.fused_kv_writes)
    model.transformer.store_kv_by_kernel(profile.talker.fused_qk_rope_store)
    model.transformer.defer_residuals(profile.talker.deferred_residuals)
    model.transformer.use_fp8_scales_later(profile.talker.fp8_fused_scales)
    model.transformer.use_fp8_norms(profile.talker.fp8_fused_norms)
    if profile.talker.compile and str(device).startswith("cuda") and not profile.talker.batch_invariant:
        model.compile_hot_paths()
    return model


def load_talker_runner(model_dir: str | Path, profile: Profile, device: str) -> LocalV15Runner:
    """The `LocalV15Runner` a profile asks for: its model as `load_served_model` prepares it, and
    `talker.*` capacity, attention kernel and graphs."""
    model = load_served_model(model_dir, profile, device)
    return LocalV15Runner(model, overlap_steps=profile.talker.overlap_steps,
                          mixed_step_tokens=profile.talker.mixed_step_tokens,
                          fused_sampling=profile.talker.fused_sampling, **talker_runner_options(profile, device))
