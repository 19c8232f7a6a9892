"""The talker worker process: continuous batching over a `TalkerRunner`, frames cut into chunks.

Loop (`TalkerLoop.step`): drain the inbox (blocking on its doorbell only when idle) → admit
waiting requests the runner has room for → one `runner.step()` → push each frame into its
request's chunk accumulator and send full chunks to the codec; a finished or aborted request
sends its final record (partial chunk or empty terminal). Every request the talker receives ends
with exactly one final `CodeChunk`, whatever happens to it: the codec closes its stream on it.

A request submitted with `open_input` gets more input in `Feed` records (held here until it is
admitted); when its input runs out the runner pauses it: its pending frames go out at once, and
the loop sleeps on its inbox while nothing but paused requests is left.

When the codec worker dies, the coordinator says so (`PeerLost`): the talker drops every request
(their clients are told by the coordinator) and its codec channel, keeps its model, KV cache and
graphs, and attaches the replacement's ring when told (`Rewire`: the spec comes down the set-up
pipe), then says `Ready` again. A send that finds the codec gone first does the same drop.
The loop beats on its ring to the coordinator (`Channel.beat`) at least every `beat_s`, also
when idle, so a stopped or stuck talker is noticed and replaced.

`TalkerLoop` is the loop logic (testable in-process); `main(spec)` is the process wrapper.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ipc.errors import EndOfStream, PeerGone, RingClosed
from ipc.messages import (Abort, CodeChunk, Feed, PeerLost, Ready, Rewire, Shutdown, Slots,
                          StageError, Submit, TalkerInbox, TalkerStep)
from stages.runtime.chunk_policy import ChunkAccumulator, ChunkSchedule
from stages.variant import AdapterError, TalkerRequest, Variant
from stages.workers.heap import GcPauses, freeze_heap, thaw_heap
from stages.workers.startup import StartupLog, describe
from stages.workers.timeline import Timeline, open_timeline
from stages.workers.common import (REWIRE_TIMEOUT_S, WorkerSpec, apply_memory_plan, attach_talker,
                                  beat_interval, compile_size_oblivious, drain, kernel_names,
                                  memory_report, payload_array, prepare_process, receive_spec,
                                  schedule_from, triton_kernel_counter, use_priority_stream)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    """One request inside the talker."""

    client: int
    chunks: ChunkAccumulator
    max_frames: int
    seq: int = 0
    first_frame: bool = True
    echo: bool = False  # the client wants the codes too (`Submit.echo_codes`)
    paused: bool = False  # its input ran out (`Submit.open_input`): no frames until a `Feed`


SLOW_STEP_S = 0.25  # a step this long is logged with what it did (a busy step takes ~15-35 ms)


def compile_counter() -> Callable[[], int] | None:
    """A function returning how many graphs torch.compile has made in this process so far (a
    recompile under load stalls every stream), or None where torch does not say."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return None
    return lambda: counters["stats"]["unique_graphs"]


def allocator_counter(device: str) -> Callable[[], tuple[int, int]] | None:
    """On CUDA, a function returning (device allocations, allocation retries) of the caching
    allocator so far: a retry frees the cache and waits for the device, a stall of its own;
    None elsewhere."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    def counts() -> tuple[int, int]:
        stats = torch.cuda.memory_stats(device)
        return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)

    return counts


class UnknownMessage(RuntimeError):
    """A record this worker does not handle reached its inbox."""


class TalkerLoop:
    """Runner + chunk policy + channels. `step()` is one scheduler iteration."""

    def __init__(self, runner: Any, inbox: Any, to_codec: Any, to_coord: Any,
                 schedule: ChunkSchedule, n_vq: int, timeline: Timeline | None = None,
                 allocator: Callable[[], tuple[int, int]] | None = None,
                 gc_pauses: GcPauses | None = None, kernels: Callable[[], int] | None = None,
                 setup: Any = None, ready: Ready | None = None, beat_s: float | None = None) -> None:
        """`allocator`: `allocator_counter`'s function, read when a step is slow (and around every
        step while a timeline records, which then holds each step's new device allocations);
        `gc_pauses`: this process's collection timer (a step's share goes to the timeline);
        `kernels`: `triton_kernel_counter`'s function (a step's new Triton kernels, same places);
        `setup`: the set-up pipe (a replaced codec's spec arrives there), `ready`: the record sent
        again once a new codec is attached; `beat_s`: the longest sleep between two beats."""
        self.runner = runner
        self.setup, self.ready, self.beat_s = setup, ready, beat_s
        self.timeline = timeline
        if timeline is not None and hasattr(runner, "time_steps"):
            runner.time_steps()  # each step's GPU span and the GPU's idle time before it, for the timeline
        self.inbox, self.to_codec, self.to_coord = inbox, to_codec, to_coord
        self.schedule = schedule
        self.n_vq = n_vq
        self.waiting: deque[tuple[Submit, TalkerRequest]] = deque()  # not yet admitted to the runner
        self.streams: dict[int, _Stream] = {}
        self.early_feeds: dict[int, list[tuple[Feed, np.ndarray]]] = {}  # for waiting requests
        self.shutdown: Shutdown | None = None
        self._slots_reported = -1
        self._steps: tuple[int, int, float] = (0, 0, 0.0)  # (batch, steps, seconds) not yet sent
        self._rows_sent = (0, 0)  # the scheduler's (prompt, cached) row counters when last sent
        self._graphs_made = getattr(runner, "graphs_made", lambda: 0)
        self._compiles = compile_counter() or (lambda: 0)
        self._kernels = kernels or (lambda: 0)
        self._allocator = allocator
        self._gc = gc_pauses
        self._allocs_seen = allocator() if allocator is not None else (0, 0)

    def has_work(self) -> bool:
        """Something to step: a request waiting for room, or one not paused for input."""
        return bool(self.waiting) or any(not s.paused for s in self.streams.values())

    def run(self) -> None:
        while self.step():
            pass

    def step(self) -> bool:
        """One iteration; False once a shutdown has been handled and nothing is left."""
        t_wait = time.monotonic()
        try:
            for msg, rec in drain(self.inbox, block=not self.has_work(), timeout=self.beat_s):
                self._handle(msg, rec)
        except (EndOfStream, PeerGone) as exc:  # the coordinator is gone: stop, dropping work
            log.warning("talker: inbox ended (%s): stopping", exc)
            return False
        self.to_coord.beat()
        t_drained = time.monotonic()
        admitted = self._admit()
        if self.streams:
            graphs, compiles, kernels_at = self._graphs_made(), self._compiles(), self._kernels()
            gc_s = self._gc.seconds if self._gc is not None else 0.0
            allocs = self._step_allocs()
            batch, t0 = self.runner.num_running(), time.monotonic()
            events = self.runner.step()
            t1 = time.monotonic()
            graphs, compiles = self._graphs_made() - graphs, self._compiles() - compiles
            kernels = self._kernels() - kernels_at
            gc_s = self._gc.seconds - gc_s if self._gc is not None else 0.0
            allocs = self._step_allocs() - allocs
            self._count_step(batch, t1 - t0)
            observe = getattr(getattr(self.runner, "scheduler", None), "observe_step", None)
            if observe is not None and not getattr(self.runner, "overlap_steps", False):
                observe(t1 - t0)  # the scheduler's step-cost model (`talker.max_step_ms`): step by step only
            self._emit(events)
            if self.to_codec is None:  # a send found the codec gone: nothing left to serve
                self._drop_all("the codec worker is gone")
            sched = getattr(self.runner, "scheduler", None)
            decode, prefill = getattr(sched, "last_batch", (0, 0))
            if t1 - t0 > SLOW_STEP_S:
                self._log_slow_step(t1 - t0, batch, decode, prefill, getattr(sched, "last_cached", 0),
                                    graphs, compiles, kernels, gc_s, kernel_names(self._kernels, kernels_at))
            if self.timeline is not None:
                self.timeline.add("talker_step", t0, dur=t1 - t0, emit=time.monotonic() - t1,
                                  **self._gpu_times(),
                                  drain=t_drained - t_wait, admit=t0 - t_drained, batch=batch,
                                  frames=len(events), decode=decode, prefill=prefill,
                                  cached=getattr(sched, "last_cached", 0), admitted=admitted,
                                  graphs=graphs, compiles=compiles, kernels=kernels, gc=gc_s, allocs=allocs)
        self._report_slots()
        return not (self.shutdown is not None and not self.has_work())

    def _gpu_times(self) -> dict[str, Any]:
        """For the timeline, the steps read back in this iteration as the GPU timed them (runners
        with `time_steps`, on CUDA): the idle time before them in seconds, and each one's
        [span in seconds, decode rows, prompt tokens]."""
        gpu = getattr(self.runner, "take_step_times", list)()  # [StepTime]
        if not gpu:
            return {}
        return {"gpu_idle": sum(t.idle_ms for t in gpu if t.idle_ms is not None) / 1e3,
                "gpu_steps": [[t.span_ms / 1e3, t.decode_rows, t.prefill_tokens] for t in gpu]}

    def _step_allocs(self) -> int:
        """The caching allocator's device allocations so far, read only while a timeline records
        (a statistics call a step, which serving alone does not pay)."""
        if self.timeline is None or self._allocator is None:
            return 0
        return self._allocator()[0]

    def _log_slow_step(self, seconds: float, batch: int, decode: int, prefill: int, cached: int,
                       graphs: int, compiles: int, kernels: int, gc_s: float, names: str = "") -> None:
        """A step over `SLOW_STEP_S`, with what might have stalled it (`names`: the Triton kernels
        it specialised, `kernel_names`)."""
        allocator = ""
        if self._allocator is not None:
            seen, self._allocs_seen = self._allocs_seen, self._allocator()
            allocator = (f"; since ready or the last slow step the CUDA allocator made "
                         f"{self._allocs_seen[0] - seen[0]} device allocation(s) and "
                         f"{self._allocs_seen[1] - seen[1]} retry(ies)")
        log.warning("talker: a %.0f ms step: %d running, %d decode rows, %d prompt tokens (%d from the "
                    "prefix cache); it recorded %d graph(s), compiled %d, specialised %d Triton kernel(s) and "
                    "collected garbage for %.0f ms%s%s",
                    seconds * 1e3, batch, decode, prefill, cached, graphs, compiles, kernels, gc_s * 1e3, allocator,
                    f"; kernels specialised{names}" if names else "")

    # ---- inbox ---------------------------------------------------------------------------------

    def _handle(self, msg: TalkerInbox, rec: Any) -> None:
        match msg:
            case Submit():
                rows = payload_array(rec, np.int64, 1 + self.n_vq)  # [S + T, 1 + n_vq], owned
                self.waiting.append((msg, TalkerRequest.from_payload(rows, msg.sampling, msg.prime_frames)))
            case Feed(rid=rid):
                rows = payload_array(rec, np.int64, 1 + self.n_vq)
                if rid in self.streams:
                    self._feed(rid, msg, rows)
                elif any(submit.rid == rid for submit, _ in self.waiting):
                    self.early_feeds.setdefault(rid, []).append((msg, rows))
                # else: it has ended; nothing reads its input any more
            case Abort(rid=rid):
                self._abort(rid)
            case Shutdown(drain=drain_first):
                self.shutdown = msg
                if not drain_first:
                    for rid in [s.rid for s, _ in self.waiting] + list(self.streams):
                        self._abort(rid)
            case PeerLost(stage="codec"):
                self._drop_all("the codec worker died")
                if self.to_codec is not None:
                    self.to_codec.close()
                    self.to_codec = None
            case Rewire(stage="codec"):
                self._attach_codec()
            case PeerLost() | Rewire():
                pass  # a peer this worker has no channel to
            case _:
                raise UnknownMessage(msg)

    def _drop_all(self, why: str) -> None:
        """Forget every request without a final record (there is no codec to send it to; the
        coordinator ends them for their clients); the runner frees their KV cache."""
        if self.waiting or self.streams:
            log.warning("talker: %s: dropping %d running and %d waiting requests", why,
                        len(self.streams), len(self.waiting))
        for rid in list(self.streams):
            self.runner.remove(rid)
        self.streams.clear()
        self.waiting.clear()
        self.early_feeds.clear()

    def _attach_codec(self) -> None:
        """A new codec worker replaced the dead one: open its ring (spec on the set-up pipe) and
        say Ready again, so the coordinator puts the replica back in service."""
        self._drop_all("the codec worker was replaced")
        if self.to_codec is not None:
            self.to_codec.close()
        self.to_codec = None
        t0 = time.monotonic()
        self.to_codec = receive_spec(self.setup, REWIRE_TIMEOUT_S, "new codec's ring").open()
        log.info("talker: attached the new codec worker's ring in %.2f s", time.monotonic() - t0)
        if self.ready is not None:
            self.to_coord.send(self.ready)

    def _feed(self, rid: int, feed: Feed, rows: np.ndarray) -> None:
        try:
            self.runner.feed(rid, rows, final=feed.final, forced_frames=feed.forced_frames)
        except Exception as exc:  # a bad request must not take the worker down
            log.exception("talker: input of request %d refused by the runner", rid)
            self.to_coord.send(StageError(stage="talker", message=str(exc), rid=rid))
            self._abort(rid)
            return
        self.streams[rid].paused = False

    def _abort(self, rid: int) -> None:
        self.early_feeds.pop(rid, None)
        for i, (submit, _) in enumerate(self.waiting):
            if submit.rid == rid:
                del self.waiting[i]
                self._send_final(rid, submit.client, 0, None, "abort")
                return
        stream = self.streams.pop(rid, None)
        if stream is not None:  # unknown: already finished, its final record is on its way
            self.runner.remove(rid)
            self._send_final(rid, stream.client, stream.seq, None, "abort")

    def _admit(self) -> int:
        """Move waiting requests into the runner while it has room; returns how many."""
        admitted = 0
        if self.to_codec is None:  # sent before the coordinator knew the codec was gone
            self._drop_all("no codec worker")
            return 0
        # With nothing running, nothing will free up: try anyway, so a prompt too long for the
        # whole KV cache fails alone (the runner raises) instead of blocking the queue.
        while self.waiting and (self.runner.can_admit(len(self.waiting[0][1].prompt))
                                or self.runner.num_running() == 0):
            submit, request = self.waiting.popleft()
            try:
                self.runner.add(submit.rid, request.prompt, request.sampling)
                if submit.open_input:
                    self.runner.open_input(submit.rid)
            except Exception as exc:  # a bad request must not take the worker down
                log.exception("talker: request %d rejected by the runner", submit.rid)
                self.runner.remove(submit.rid)
                self.early_feeds.pop(submit.rid, None)
                self.to_coord.send(StageError(stage="talker", message=str(exc), rid=submit.rid))
                self._send_final(submit.rid, submit.client, 0, None, "error")
                continue
            if request.prime_codes is not None:  # continuation: the codec decodes these first
                self._send_codes(CodeChunk(rid=submit.rid, client=submit.client, seq=-1,
                                           final=False, prime=True), request.prime_codes)
            self.streams[submit.rid] = _Stream(
                client=submit.client, max_frames=request.sampling.max_new_frames,
                chunks=ChunkAccumulator(self.schedule.with_initial(submit.initial_chunk_frames),
                                        self.n_vq), echo=submit.echo_codes)
            for feed, rows in self.early_feeds.pop(submit.rid, ()):  # input that came while it waited
                self._feed(submit.rid, feed, rows)
            admitted += 1
            if self.timeline is not None:
                self.timeline.add("talker_admit", time.monotonic(), rid=submit.rid, rows=len(request.prompt))
        return admitted

    # ---- runner output -------------------------------------------------------------------------

    def _emit(self, events: list[Any]) -> None:
        for ev in events:
            stream = self.streams.get(ev.rid)
            if stream is None:
                continue
            if ev.codes is not None:
                if stream.first_frame and self.timeline is not None:
                    self.timeline.add("talker_first_frame", time.monotonic(), rid=ev.rid)
                stream.first_frame = False
                chunk = stream.chunks.push(np.asarray(ev.codes, dtype=np.int64))
                if chunk is None and ev.paused:  # its input ran out: what it made is heard now
                    chunk = stream.chunks.flush()
                if chunk is not None and len(chunk):
                    self._send_codes(CodeChunk(rid=ev.rid, client=stream.client, seq=stream.seq,
                                               final=False, echo_codes=stream.echo), chunk)
                    stream.seq += 1
            if ev.paused:
                stream.paused = True
            reason = ev.reason if ev.finished else None
            if reason is None and stream.chunks.frames_seen >= stream.max_frames:
                reason = "length"  # runaway guard: the runner did not stop at the frame cap
            if ev.finished or reason is not None:
                if self.timeline is not None:
                    self.timeline.add("talker_done", time.monotonic(), rid=ev.rid,
                                      frames=stream.chunks.frames_seen)
                del self.streams[ev.rid]
                self.runner.remove(ev.rid)
                self._send_final(ev.rid, stream.client, stream.seq, stream.chunks.finish(),
                                 reason or "stop", echo=stream.echo)

    def _send_final(self, rid: int, client: int, seq: int, codes: np.ndarray | None,
                    reason: str, echo: bool = False) -> None:
        if codes is None:
            codes = np.zeros((0, self.n_vq), dtype=np.int64)
        self._send_codes(CodeChunk(rid=rid, client=client, seq=seq, final=True,
                                   finish_reason=reason, echo_codes=echo), codes)

    def _send_codes(self, msg: CodeChunk, codes: np.ndarray) -> None:
        """Codes `[T, n_vq]` in records that fit the codec's ring: a chunk too large for one
        record goes as several (decoding them in turn equals decoding it whole), the last one
        carrying `final`."""
        if self.to_codec is None:
            return
        per_record = max(1, self.to_codec.max_payload_size // (8 * self.n_vq))
        for start in range(0, max(1, len(codes)), per_record):
            last = start + per_record >= len(codes)
            piece = msg if last else msgspec.structs.replace(msg, final=False, finish_reason=None)
            try:
                self.to_codec.send(piece, codes[start:start + per_record])
            except (PeerGone, RingClosed) as exc:  # the step's end drops every request
                log.warning("talker: the codec worker is gone (%s)", exc)
                self.to_codec.close()
                self.to_codec = None
                return

    def _count_step(self, batch: int, seconds: float) -> None:
        """Aggregate step statistics: one record per run of equal batch sizes (at most 64)."""
        b, n, t = self._steps
        if n and (b != batch or n >= 64):
            self._flush_steps()
            b, n, t = self._steps
        self._steps = (batch, n + 1, t + seconds)

    def _flush_steps(self) -> None:
        batch, steps, seconds = self._steps
        if steps:
            sched = getattr(self.runner, "scheduler", None)
            rows = (getattr(sched, "prompt_tokens", 0), getattr(sched, "cached_tokens", 0))
            self.to_coord.send(TalkerStep(batch=batch, steps=steps, step_s=seconds,
                                          prompt_rows=rows[0] - self._rows_sent[0],
                                          cached_rows=rows[1] - self._rows_sent[1]))
            self._rows_sent = rows
        self._steps = (0, 0, 0.0)

    def _report_slots(self) -> None:
        in_use = self.runner.num_running()
        if in_use != self._slots_reported:
            self._flush_steps()
            self.to_coord.send(Slots(stage="talker", in_use=in_use))
            self._slots_reported = in_use


WARM_CAPTURE_BUDGET_S = 180.0  # graph captures at start-up stop after this long (largest first)
WARM_SERVING_REQUESTS = 8  # the serving-size warm-up batch: requests prefilled together
WARM_SERVING_TEXT_REPEATS = 12  # ... each with the warm-up text this many times over
WARM_SERVING_REFERENCE_FRAMES = 60  # ... and a reference of this many frames, where the family takes one


def serving_size_request(variant: Variant, voice: int = 0) -> Any:
    """A warm-up request shaped like a served one: the warm-up text many times over and, where
    the family takes a reference, a reference of `WARM_SERVING_REFERENCE_FRAMES` frames (codes
    `voice`: their values do not matter) with its transcript, so its prompt is a few hundred rows,
    as real ones are (without the reference if the family's rules refuse this one). Requests of
    different `voice` differ from their first text or reference row on (the talker's prefix cache
    must not skip their prefill: the warm-up is there to run it)."""
    job = variant.warm_up_job()
    job.text = " ".join([f"Voice {voice}."] + [job.text] * WARM_SERVING_TEXT_REPEATS)
    job.forced_frames = 4
    plain = variant.build_request(job)
    if "reference" not in variant.used_fields:
        return plain
    job.ref_codes = np.full((WARM_SERVING_REFERENCE_FRAMES, variant.n_vq), voice, dtype=np.int64)
    if "ref_text" in variant.used_fields:
        job.ref_text = "warm up."
    try:
        return variant.build_request(job)
    except AdapterError:
        return plain


def run_together(runner: Any, requests: list[tuple[int, Any]], max_steps: int) -> None:
    """Add the (rid, request) pairs that fit at once and step until they finish (at most
    `max_steps` steps), then remove them (a request cut short frees its state too)."""
    rids = set()
    for rid, request in requests:
        if runner.can_admit(len(request.prompt)):
            runner.add(rid, request.prompt, request.sampling)
            rids.add(rid)
    done: set[int] = set()
    for _ in range(max_steps):
        if done >= rids:
            break
        done.update(ev.rid for ev in runner.step() if ev.finished)
    for rid in rids:
        runner.remove(rid)


def wide_batch(runner: Any, serving: list[Any]) -> list[tuple[int, Any]]:
    """The serving-size requests again, one more than a prefill-graph replay holds (as many as
    the runner runs at most): with the prefix cache they all start from their prompts' cached
    blocks, so their few remaining rows are prefilled in one step of many chunks, the runner's
    eager call (served, a step takes no more chunks than a prefill-graph replay holds,
    `talker.prefill_graph_seqs`; the eager call remains for a chunk no replay fits, a long
    prompt's, and is compiled here with that cap lifted). On a fresh machine the first such
    step came with the first burst of requests for known voices and took 2.8 s (compiling, by all signs: a later
    server on that machine, its compile caches on disk, had no such step), stalling every stream."""
    wide = min(runner.max_running, max(len(serving), getattr(runner, "prefill_graph_seqs", 0) + 1))
    return [(-100 - j, serving[j % len(serving)]) for j in range(wide)]


def warm_up_batches(runner: Any, variant: Variant,
                    shaped: bool = True) -> list[tuple[str, list[tuple[int, Any]], int]]:
    """The warm-up's batches of requests, in order: (name, [(rid, request)], most steps): one
    alone, then two together (torch.compile specialises a batch of one, so a batch of two is
    what compiles the shape-generic code), then a serving-size batch (`serving_size_request`:
    prefill steps of about a thousand rows over several prompts, as under load, so the kernels of
    those shapes are compiled before the first request rather than during it), then a wide batch
    (`wide_batch`: those prompts again, many at once, as a burst of requests for known voices
    comes; run with the scheduler's chunk cap lifted). The jobs are the variant's
    (`warm_up_job`); a runner of one or two slots, or one that compiles nothing a shape (not
    `shaped`: a talker on the CPU), gets the first ones only."""
    request = variant.build_request(variant.warm_up_job())
    batches = [("alone", [(-1, request)], 8)]
    if runner.max_running >= 2:
        batches.append(("two", [(-2, request), (-3, request)], 8))
    n = min(WARM_SERVING_REQUESTS, runner.max_running)
    if n > 2 and shaped:
        serving = [serving_size_request(variant, i) for i in range(n)]
        batches.append(("serving", [(-10 - i, r) for i, r in enumerate(serving)], 64))
        batches.append(("wide", wide_batch(runner, serving), 64))
    return batches


def warm_up(runner: Any, variant: Variant, capture_ahead: bool = False, startup: StartupLog | None = None,
            shaped: bool = True) -> None:
    """Run short requests through the runner so first requests do not pay for lazy set-up
    (`warm_up_batches`; `shaped`: the serving-size batches too, whose shapes a CUDA talker
    compiles and tunes kernels for), then launch every attention kernel variant a step can launch
    (`warm_attention`: the eager path's split counts follow its batch). Then, with
    `capture_ahead` (`talker.capture_ahead`), the runner records every graph it can ahead;
    without it, the decode graphs of every batch bucket when one block-table width serves them
    all (`capture_decode_graphs`: a few per sampler mode met) and the prefill graphs
    (`talker.prefill_graphs`), so no capture stalls the streams of the first requests.

    Each batch is a line (n of N, its requests and prompt rows, its seconds and the compiles in
    them), each compile a line, each capture a line every tenth or 10 s; the times go into
    `startup`'s phases (a log of its own when none is given)."""
    own = startup is None
    startup = startup or StartupLog("talker", log.info)
    try:
        batches = warm_up_batches(runner, variant, shaped)
        for i, (name, requests, max_steps) in enumerate(batches, 1):
            rows = sum(len(r.prompt) for _, r in requests)
            doing = (f"warm-up batch {i} of {len(batches)} ({name}: {len(requests)} "
                     f"request{'s' if len(requests) > 1 else ''}, {rows} prompt rows)")
            uncapped = getattr(getattr(runner, "scheduler", None), "chunks_uncapped", nullcontext)
            with startup.phase("warm-up", doing) as span, (uncapped() if name == "wide" else nullcontext()):
                run_together(runner, requests, max_steps)  # wide: all its chunks in one step, the eager call
            compiled = (f", {span.compile_seconds:.1f} s of it compiling ({span.compiles} "
                        f"compile{'s' if span.compiles > 1 else ''})" if span.compiles else "")
            log.info("talker: %s: %.1f s%s", doing, span.seconds, compiled)
        with startup.phase("warm-up", "the attention kernel variants") as span:
            warmed = getattr(runner, "warm_attention", lambda: 0)()
        if warmed:
            log.info("talker: %d attention kernel variants launched in %.1f s", warmed, span.seconds)
        if capture_ahead:
            startup.capture("graphs ahead", lambda p: runner.capture_ahead(WARM_CAPTURE_BUDGET_S, p))
            return
        startup.capture("decode graphs", lambda p: runner.capture_decode_graphs(WARM_CAPTURE_BUDGET_S, p))
        if getattr(runner, "prefill_graphs", None) is not None:  # one per token bucket: seconds, not minutes
            startup.capture("prefill graphs", lambda p: runner.capture_prefill_graphs(WARM_CAPTURE_BUDGET_S, p))
    finally:
        if own:
            startup.close()


def main(spec: WorkerSpec) -> None:
    """Process entry: load the talker, warm up, say Ready, loop until shutdown."""
    variant = prepare_process(spec, spec.profile.talker.torch_threads)
    if spec.profile.talker.compile_size_oblivious:
        compile_size_oblivious()
    if spec.profile.talker.priority_stream:
        use_priority_stream(spec.device)
    inbox, to_codec, to_coord = attach_talker(spec)
    runner = None
    timeline = open_timeline(spec.profile.engine.timeline_dir, f"talker{spec.replica}")
    gc_pauses: GcPauses | None = None
    startup = StartupLog("talker", log.info, spec.spawned_at)
    try:
        variant, plan = apply_memory_plan(spec, variant)
        with startup.phase("load", "the model's load") as span:
            runner = variant.make_talker_runner(spec.device)
        log.info("talker: loaded in %.1f s", span.seconds)
        warm_up(runner, variant, spec.profile.talker.capture_ahead, startup,
                shaped=str(spec.device).startswith("cuda"))
        frozen = freeze_heap()
        times = startup.times()
        log.info("talker: ready in %s (%d objects frozen out of garbage collection)", describe(times), frozen)
        gc_pauses = GcPauses("talker")
        ready = Ready(stage="talker", pid=os.getpid(), capacity=spec.profile.talker.max_running,
                      max_prompt_rows=runner.max_prompt_rows(),
                      memory=memory_report("talker", plan, spec.device), startup=times)
        to_coord.send(ready)
        loop = TalkerLoop(runner, inbox, to_codec, to_coord, schedule_from(spec.profile),
                          variant.n_vq, timeline, allocator_counter(spec.device), gc_pauses,
                          triton_kernel_counter(spec.device), setup=spec.setup, ready=ready,
                          beat_s=beat_interval(spec.profile))
        loop.run()
        to_codec = loop.to_codec  # the one open now (a replaced codec's), closed below
    except Exception as exc:
        log.exception("talker worker failed")
        to_coord.send(StageError(stage="talker", message=f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        startup.close()
        if runner is not None:  # a tensor-parallel runner stops its follower ranks
            runner.close()
        if gc_pauses is not None:
            gc_pauses.close()
        thaw_heap()
        if timeline is not None:
            timeline.close()
        for ch in (inbox, to_codec, to_coord):
            if ch is not None:
                ch.close()
