"""The codec worker process: coalesced streaming decode per request, reference encoding between.

Inputs: code chunks from the talker (one stream per request; a slot is opened on its first chunk
and closed on its final record) and control from the coordinator (aborts, reference-encode jobs,
shutdown). Each loop iteration (`CodecLoop.step`): drain both inboxes (sleeping on their doorbells
only when nothing is runnable, up to the coalescing deadline) → hand terminal records (no frames)
straight through → decode requests' first chunks at once (express; with `express_joins_dispatch`,
inside the batch due now if one is) → ask the `Coalescer` whether to decode now → decode one
chunk of each chosen stream in one call → PCM records to each request's client ring, a
`ChunkDone` per chunk and a `DecodeBatch` per dispatch to the coordinator → send the codes of the reference-encode batch
the encoder thread finished, and hand it the jobs waiting since as the next batch
(`stages.workers.encoder_thread`: its own thread and CUDA stream, so an encode batch never holds
up the decode loop; while streams are open a batch may be kept smaller, `encode_batch_streaming`,
since it shares the GPU with their decoding).

An aborted stream drops its waiting chunks at once and skips any that still arrive; it closes on
its final record (the talker always sends one), so nothing is left behind.

A talker that dies (its ring reports it, or the coordinator's `PeerLost`) takes its streams with
it: their slots are freed at once and the codec waits for the replacement (`Rewire`: it makes a
new talker → codec ring and sends its spec up the set-up pipe), keeping its model and graphs. An
API process that is replaced gets a new PCM ring the same way. The loop beats on its ring to the
coordinator (`Channel.beat`) at least every `beat_s`, also when idle.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from ipc.doorbell import wait_any
from ipc.errors import ChannelTimeout, EndOfStream, PeerGone, RingClosed
from ipc.messages import (Abort, ChunkDone, CodecInbox, CodeChunk, Codes, DecodeBatch, EncodeDone,
                          EncodeRequest, EncodeResult, PcmChunk, PeerLost, Ready, Rewire, Shutdown,
                          Slots, StageError)
from stages.models.codec.serving import chunk_lengths, encode_batch_samples
from stages.runtime.coalescer import Coalescer
from stages.workers.common import (CodecRings, WorkerSpec, apply_memory_plan, attach_codec,
                                  beat_interval, drain, kernel_names, memory_report, payload_array,
                                  prepare_process, triton_kernel_counter, use_priority_stream)
from stages.workers.encoder_thread import EncoderThread
from stages.workers.heap import GcPauses, freeze_heap, thaw_heap
from stages.workers.startup import StartupLog, describe
from stages.workers.timeline import Timeline, open_timeline

log = logging.getLogger(__name__)

SLOW_DISPATCH_S = 0.25  # a dispatch this long is logged with what it did (a busy one takes ~15-60 ms)


def _log_encode_failure(reason: str) -> None:
    log.warning("codec: batched reference encode failed (%s); retried one by one", reason)


class UnknownMessage(RuntimeError):
    """A record this worker does not handle reached its inbox."""


@dataclass(slots=True)
class _Stream:
    """One request's decode stream."""

    client: int
    waiting: deque[tuple[CodeChunk, np.ndarray, float]] = field(default_factory=deque)
    slot_open: bool = False
    aborted: bool = False
    first_out: float | None = None  # when its first audio went to its client
    audio_out_s: float = 0.0  # seconds of audio sent to its client


class CodecLoop:
    """Runner + coalescer + channels. `step()` is one iteration."""

    def __init__(self, runner: Any, from_talker: Any, from_coord: Any, to_coord: Any,
                 to_clients: list[Any], coalescer: Coalescer, encode_batch: int,
                 clock: Any = time.monotonic, client_stall_s: float = 5.0,
                 timeline: Timeline | None = None, express_first_chunks: bool = False,
                 express_joins_dispatch: bool = False, patient_wait_s: float = 0.0,
                 buffer_margin_s: float = 0.2, final_wait_s: float | None = None,
                 encode_batch_streaming: int | None = None, encode_batch_samples: int | None = None,
                 kernels: Callable[[], int] | None = None, setup: Any = None,
                 rings: CodecRings | None = None, beat_s: float | None = None,
                 encoder: EncoderThread | None = None) -> None:
        """`encode_batch`: reference-encode jobs run together at most; `encode_batch_streaming`:
        at most while any stream is open (the batch shares the GPU with their decoding), None =
        `encode_batch`; `encode_batch_samples`: a batch's clips padded to its longest hold at
        most this many samples a channel in all (clips x longest; a first clip always goes), None =
        no bound but the count; `encoder`: where batches are encoded (an `EncoderThread` over
        `runner.encode` unless given); `kernels`: `triton_kernel_counter`'s function (a
        dispatch over `SLOW_DISPATCH_S` says how many Triton kernels it specialised); `setup` and
        `rings`: the set-up pipe and the ring maker for replaced peers (`Rewire`); `beat_s`: the
        longest sleep between two beats."""
        self.setup, self.rings, self.beat_s = setup, rings, beat_s
        self.client_stall_s = client_stall_s
        self.patient_wait_s, self.buffer_margin_s = patient_wait_s, buffer_margin_s
        self.final_wait_s = final_wait_s
        self.express_first_chunks = express_first_chunks
        self.express_joins_dispatch = express_joins_dispatch
        self.timeline = timeline
        self._dead_clients: set[int] = set()
        self.runner = runner
        self.from_talker, self.from_coord, self.to_coord = from_talker, from_coord, to_coord
        self.to_clients = to_clients
        self.coalescer = coalescer
        self.encode_batch = encode_batch
        self.encode_batch_streaming = encode_batch if encode_batch_streaming is None \
            else min(encode_batch, encode_batch_streaming)
        self.encode_batch_samples = encode_batch_samples
        self.clock = clock
        self.streams: dict[int, _Stream] = {}
        self.encodes: deque[tuple[EncodeRequest, np.ndarray, float]] = deque()  # waiting: job, [C, S], arrival
        self.encoder = encoder or EncoderThread(runner.encode, str(getattr(runner, "device", "cpu")),
                                                on_failure=_log_encode_failure)
        self.shutdown: Shutdown | None = None
        self._ended: set[Any] = set()  # inboxes whose writer closed or died
        self._slots_reported = -1
        self._kernels = kernels or (lambda: 0)

    def run(self) -> None:
        while self.step():
            pass

    def step(self) -> bool:
        """One iteration; False once a shutdown was received and no stream is left."""
        self._wait_and_drain()
        self._pass_terminals()
        express = self._express_ready()
        joining: tuple[int, ...] = ()
        if express:  # first chunks go at once, in their own small call, ahead of any batch...
            self.coalescer.take(express)
            if self.express_joins_dispatch:
                joining = express  # ...or in the batch due now, if one is (one call, fewer replays)
            else:
                self._decode(express)
        decision = self.coalescer.decide(self.clock(), alive=self._alive())
        if joining or decision.dispatch:
            self._decode(joining + decision.dispatch)
        self._finish_encodes()
        self._start_encodes()
        self._report_slots()
        self.to_coord.beat()
        return not (self.shutdown is not None and not self.encodes and not self.encoder.in_flight
                    and (not self.streams or len(self._ended) == 2 or self.from_talker is None))

    # ---- inboxes -------------------------------------------------------------------------------

    def _wait_and_drain(self) -> None:
        inboxes = [ch for ch in (self.from_coord, self.from_talker)
                   if ch is not None and ch not in self._ended]
        encode_ready = bool(self.encodes) and not self.encoder.in_flight
        if inboxes and not encode_ready and not self._terminal_ready() and not self._express_ready():
            wait = self.coalescer.wait_time(self.clock(), alive=self._alive())
            if self.beat_s is not None:
                wait = self.beat_s if wait is None else min(wait, self.beat_s)
            if wait != 0.0:  # None: nothing ready, sleep until a record arrives or a batch is encoded
                wait_any([*inboxes, self.encoder.bell], wait)
        for channel in inboxes:
            if channel is not self.from_coord and channel is not self.from_talker:
                continue  # a talker ring dropped by a record just handled
            try:
                for msg, rec in drain(channel, block=False):
                    self._handle(msg, rec)
            except (EndOfStream, PeerGone) as exc:
                self._on_inbox_ended(channel, exc)

    def _on_inbox_ended(self, channel: Any, exc: BaseException) -> None:
        """The talker or the coordinator closed its end or died: nothing more can arrive. A
        talker that dies while the coordinator serves on is replaced: wait for it."""
        if channel is self.from_talker and self.shutdown is None:  # its requests fail with it
            self._talker_lost(f"the talker worker is gone ({exc})")
            return
        self._ended.add(channel)
        if self.shutdown is None:
            report = log.warning if self.streams else log.info
            report("codec: inbox ended without a shutdown (%s): stopping", exc)
            self.shutdown = Shutdown(drain=False)
        if channel is self.from_talker:  # no final records can come: close what is open
            for rid, stream in list(self.streams.items()):
                stream.aborted = True
                self._close(rid, stream, -1, "abort")

    def _handle(self, msg: CodecInbox, rec: Any) -> None:
        match msg:
            case CodeChunk():
                self._on_chunk(msg, rec)
            case Abort(rid=rid):
                stream = self.streams.get(rid)
                if stream is not None and not stream.aborted:
                    final = next((c for c, _, _ in stream.waiting if c.final), None)
                    stream.aborted = True
                    stream.waiting.clear()
                    self.coalescer.forget(rid)
                    if final is not None:  # its final record was already here: close now
                        self._close(rid, stream, final.seq, "abort")
            case EncodeRequest():
                wav = rec.array(np.float32).reshape(self.runner.channels, -1).copy()  # [C, S]
                self.encodes.append((msg, wav, time.monotonic()))
            case Shutdown():
                self.shutdown = msg
            case PeerLost(stage="talker"):
                self._talker_lost("the talker worker died")
            case Rewire(stage="talker", generation=generation):
                self._talker_lost("the talker worker was replaced")
                self.from_talker = self.rings.talker(generation)
                self.setup.send(self.from_talker.spec())
                log.info("codec: made the ring of the new talker worker")
            case Rewire(stage="client", client=client, generation=generation):
                self._client_replaced(client, generation)
            case PeerLost() | Rewire():
                pass
            case _:
                raise UnknownMessage(msg)

    def _talker_lost(self, why: str) -> None:
        """Drop every stream (no final record will come for them; the coordinator ends them for
        their clients), freeing their slots, and the talker's ring."""
        if self.from_talker is None:
            return
        if self.streams:
            log.warning("codec: %s: dropping its %d streams", why, len(self.streams))
        for rid, stream in list(self.streams.items()):
            stream.aborted = True
            stream.waiting.clear()
            self._release(rid, stream)
        self.from_talker.close()
        self._ended.discard(self.from_talker)
        self.from_talker = None

    def _client_replaced(self, client: int, generation: int) -> None:
        """API process `client` was replaced: its streams go (the coordinator aborted them), a new
        PCM ring takes the old one's place and its spec goes up the set-up pipe."""
        for rid, stream in self.streams.items():
            if stream.client == client and not stream.aborted:
                stream.aborted = True
                stream.waiting.clear()
                self.coalescer.forget(rid)
        self.to_clients[client].close()
        self.to_clients[client] = self.rings.client(client, generation)
        self._dead_clients.discard(client)
        self.setup.send(self.to_clients[client].spec())
        log.info("codec: made a new PCM ring for API process slot %d", client)

    def _on_chunk(self, chunk: CodeChunk, rec: Any) -> None:
        stream = self.streams.get(chunk.rid)
        if stream is None:
            stream = self.streams[chunk.rid] = _Stream(client=chunk.client)
            if chunk.client in self._dead_clients:  # nobody to deliver to: fail it at once
                stream.aborted = True
                self.to_coord.send(StageError(stage="codec", rid=chunk.rid,
                                              message=f"API process {chunk.client} is gone"))
        if chunk.finish_reason == "abort" or chunk.finish_reason == "error":
            stream.aborted = True
            stream.waiting.clear()
            self.coalescer.forget(chunk.rid)
        if stream.aborted:
            if chunk.final:
                reason = "error" if chunk.finish_reason == "error" else "abort"
                self._close(chunk.rid, stream, chunk.seq, reason)
            return
        codes = payload_array(rec, np.int64, self.runner.n_vq)  # [T, n_vq], owned
        now = self.clock()
        stream.waiting.append((chunk, codes, now))
        if len(codes):
            self._mark_ready(chunk.rid, stream)

    # ---- work ----------------------------------------------------------------------------------

    def _alive(self) -> int:
        return sum(not s.aborted for s in self.streams.values())

    def _mark_ready(self, rid: int, stream: _Stream) -> None:
        """The stream's head chunk is ready. With `patient_wait_s`, a steady chunk (not the
        request's first or final) of a stream whose client holds audio may wait up to that long,
        never past the moment the client's buffer would run dry less `buffer_margin_s` (its
        first audio's time plus the audio sent), for a larger, cheaper dispatch; other chunks
        keep the window's `max_wait`; a request's final chunk is due `final_wait_s` after it
        arrived when that is set."""
        chunk, _, since = stream.waiting[0]
        due = None
        if chunk.final and self.final_wait_s is not None:
            due = since + self.final_wait_s
        elif self.patient_wait_s and not chunk.final and stream.first_out is not None:
            dry = stream.first_out + stream.audio_out_s - self.buffer_margin_s
            due = max(since + self.coalescer.max_wait_s, min(since + self.patient_wait_s, dry))
        self.coalescer.mark_ready(rid, since=since, due=due)

    def _express_ready(self) -> tuple[int, ...]:
        """Streams whose waiting head is their first audio chunk, when first chunks are express
        (`coalescing.express_first_chunks`): they skip the coalescing window."""
        if not self.express_first_chunks:
            return ()
        return tuple(rid for rid, s in self.streams.items()
                     if s.waiting and s.waiting[0][0].seq == 0 and not s.waiting[0][0].prime
                     and len(s.waiting[0][1]) and not s.aborted)

    def _terminal_ready(self) -> bool:
        return any(s.waiting and len(s.waiting[0][1]) == 0 for s in self.streams.values())

    def _pass_terminals(self) -> None:
        """Terminal records (final, no frames) at the head of a stream need no model: close now."""
        for rid, stream in list(self.streams.items()):
            if stream.waiting and len(stream.waiting[0][1]) == 0:
                chunk, _, _ = stream.waiting.popleft()
                self._close(rid, stream, chunk.seq, chunk.finish_reason or "stop")

    def _decode(self, chosen: tuple[int, ...]) -> None:
        now = self.clock()
        rids, heads = [], []
        for rid in chosen:
            stream = self.streams[rid]
            if not stream.slot_open and not self._open_slot(rid, stream):
                continue
            rids.append(rid)
            heads.append(stream.waiting.popleft())
        if not rids:
            return
        waited = now - min(h[2] for h in heads)  # the oldest chunk's wait
        t0, kernels = time.monotonic(), self._kernels()
        pcms = self._decode_items([(rid, head[1]) for rid, head in zip(rids, heads)])
        decode_s = time.monotonic() - t0
        if decode_s > SLOW_DISPATCH_S:
            log.warning("codec: a %.0f ms dispatch of %d chunks (%d frames); it specialised %d Triton kernel(s)%s",
                        decode_s * 1e3, len(rids), sum(len(h[1]) for h in heads), self._kernels() - kernels,
                        kernel_names(self._kernels, kernels))
        emit_s = 0.0  # ring writes only (the record transposes and sends)
        for rid, (chunk, codes, arrived), pcm in zip(rids, heads, pcms):
            stream = self.streams[rid]
            if pcm is None:  # its decode failed: the request fails, the stream ends on its final
                if chunk.final:
                    self._close(rid, stream, chunk.seq, "error")
                continue
            if chunk.prime:  # left context only: its audio is not part of the answer
                if stream.waiting and len(stream.waiting[0][1]):
                    self._mark_ready(rid, stream)
                continue
            t1 = time.perf_counter()
            if chunk.echo_codes:  # the client continues them later: they go just ahead of the audio
                self._to_client(stream.client, Codes(rid=rid, seq=chunk.seq), codes)
            reason = chunk.finish_reason if chunk.final else None
            self._send_pcm(stream.client,  # pcm: [channels, samples], planar
                           PcmChunk(rid=rid, seq=chunk.seq, final=chunk.final,
                                    finish_reason=reason, batch_size=len(rids),
                                    waited_s=now - arrived), pcm)
            self.to_coord.send(ChunkDone(rid=rid, seq=chunk.seq, samples=pcm.shape[1],
                                         final=chunk.final, finish_reason=reason))
            emit_s += time.perf_counter() - t1
            if stream.first_out is None:
                stream.first_out = self.clock()
            stream.audio_out_s += pcm.shape[1] / self.runner.sample_rate
            if chunk.final:
                self._release(rid, stream)
            elif stream.waiting:
                if len(stream.waiting[0][1]):
                    self._mark_ready(rid, stream)
        self.to_coord.send(DecodeBatch(size=len(rids), waited_s=waited, decode_s=decode_s,
                                       emit_s=emit_s))
        if self.timeline is not None:  # chunks: [rid, seq, frames, arrived, final, prime]; calls: [rows, frames]
            self.timeline.add("codec_dispatch", t0, dur=decode_s, emit=emit_s,
                              end=time.monotonic(), n=len(rids),
                              calls=[list(c) for c in getattr(self.runner, "last_calls", ())],
                              chunks=[[rid, c.seq, len(codes), arrived, c.final, c.prime]
                                      for rid, (c, codes, arrived) in zip(rids, heads)])

    def _decode_items(self, items: list[tuple[int, np.ndarray]]) -> list[Any]:
        """PCM per item, None for an item whose decode failed (that request fails, not the
        worker): a failed batch is decoded again item by item to find the culprit (the runner
        checks every item before decoding any)."""
        try:
            return self.runner.decode(items)
        except Exception as exc:
            log.warning("codec: batched decode failed (%s); decoding one by one", exc)
        pcms: list[Any] = []
        for rid, codes in items:
            try:  # a copy: the runner's PCM may be a view valid only until its next decode
                pcms.append(np.array(self.runner.decode([(rid, codes)])[0], copy=True))
            except Exception as exc:
                log.error("codec: decode of request %d failed: %s", rid, exc)
                self._fail(rid, self.streams[rid], f"{type(exc).__name__}: {exc}")
                pcms.append(None)
        return pcms

    def _fail(self, rid: int, stream: _Stream, message: str) -> None:
        """This request fails (the coordinator tells its client); its stream ends on its final."""
        stream.aborted = True
        stream.waiting.clear()
        self.coalescer.forget(rid)
        self.to_coord.send(StageError(stage="codec", rid=rid, message=message))

    def _send_pcm(self, client: int, msg: PcmChunk, pcm: np.ndarray) -> None:
        """PCM `[channels, samples]` in records that fit the client's ring: a chunk too large for
        one record goes as several, the last one carrying `final`."""
        per_record = self.to_clients[client].max_payload_size // (4 * max(1, pcm.shape[0]))
        if pcm.shape[1] <= per_record:
            self._to_client(client, msg, pcm)
            return
        for start in range(0, pcm.shape[1], per_record):
            last = start + per_record >= pcm.shape[1]
            piece = msg if last else msgspec.structs.replace(msg, final=False, finish_reason=None)
            self._to_client(client, piece, pcm[:, start:start + per_record])
            stream = self.streams.get(msg.rid)
            if stream is not None and stream.aborted:  # the client stalled or went away
                return

    def _open_slot(self, rid: int, stream: _Stream) -> bool:
        """Lease a decode slot; when none is free (codec.max_slots below the requests in flight)
        this request fails, not the worker."""
        try:
            self.runner.open(rid)
        except Exception as exc:
            log.error("codec: no decode slot for request %d: %s", rid, exc)
            stream.aborted = True
            stream.waiting.clear()
            self.to_coord.send(StageError(stage="codec", rid=rid, message=str(exc)))
            return False
        stream.slot_open = True
        return True

    def _close(self, rid: int, stream: _Stream, seq: int, reason: str) -> None:
        """End a stream without decoding: an empty final PCM record (unless aborted) and done.

        An aborted or failed stream sends its client nothing: the client has gone (abort), or
        the coordinator tells it (deadline, error)."""
        if not stream.aborted:
            empty = np.zeros((self.runner.channels, 0), dtype=np.float32)
            self._to_client(stream.client,
                            PcmChunk(rid=rid, seq=seq, final=True, finish_reason=reason), empty)
        self.to_coord.send(ChunkDone(rid=rid, seq=seq, samples=0, final=True,
                                     finish_reason=reason))
        self._release(rid, stream)

    def _release(self, rid: int, stream: _Stream) -> None:
        if stream.slot_open:
            self.runner.close(rid)
        self.coalescer.forget(rid)
        del self.streams[rid]

    def _start_encodes(self) -> None:
        """Hand the waiting reference-encode jobs to the encoder thread as one batch, unless one
        is still in flight (then they wait and the next batch is larger). With encode graphs, a
        batch that one replays takes no job that would send it down the eager path; the job
        leads the next batch instead."""
        if not self.encodes or self.encoder.in_flight:
            return
        most = self.encode_batch_streaming if self.streams else self.encode_batch
        graphs = self.runner.encode_graphs  # None without encode graphs
        batch = [self.encodes.popleft()]
        longest = batch[0][1].shape[1]  # samples a channel
        while self.encodes and len(batch) < most:
            wider = max(longest, self.encodes[0][1].shape[1])  # the batch is padded to its longest
            if self.encode_batch_samples is not None and (len(batch) + 1) * wider > self.encode_batch_samples:
                break
            if graphs is not None and graphs.fits(len(batch), longest) and not graphs.fits(len(batch) + 1, wider):
                break
            batch.append(self.encodes.popleft())
            longest = wider
        note = None
        if self.timeline is not None:  # how long its jobs waited here, and how many wait on
            now = time.monotonic()
            waits = [now - arrived for _, _, arrived in batch]
            note = {"waited": sum(waits) / len(waits), "waited_max": max(waits), "left": len(self.encodes)}
        self.encoder.submit([job for job, _, _ in batch], [wav for _, wav, _ in batch], note)

    def _finish_encodes(self) -> None:
        """Send the codes (or the error) of every batch the encoder thread finished."""
        for batch in self.encoder.done():
            if self.timeline is not None:
                self.timeline.add("codec_encode", batch.started, dur=batch.seconds, n=len(batch.jobs),
                                  handed=batch.started - batch.submitted, **batch.note)
            for job, codes, error in zip(batch.jobs, batch.codes, batch.errors):
                self._to_client(job.client, EncodeResult(job=job.job, error=error), codes)
                self.to_coord.send(EncodeDone(job=job.job))

    def _to_client(self, client: int, msg: Any, payload: Any) -> None:
        """Write to an API process's ring. A process that has gone loses its streams for good; one
        that leaves its ring full for `client_stall_s` (overloaded) loses the streams it has now
        (the coordinator fails them), not its later ones; never the codec."""
        if client in self._dead_clients:
            return
        try:
            self.to_clients[client].send(msg, payload, timeout=self.client_stall_s)
        except (PeerGone, ChannelTimeout, RingClosed) as exc:
            gone = not isinstance(exc, ChannelTimeout)
            log.error("codec: client %d cannot take records (%s): failing its %sstreams",
                      client, exc, "" if gone else "current ")
            if gone:
                self._dead_clients.add(client)
            for rid, stream in self.streams.items():
                if stream.client == client and not stream.aborted:
                    stream.aborted = True
                    stream.waiting.clear()
                    self.coalescer.forget(rid)
                    self.to_coord.send(StageError(stage="codec", rid=rid,
                                                  message=f"API process {client} stalled or gone"))

    def _report_slots(self) -> None:
        in_use = self.runner.num_open()
        if in_use != self._slots_reported:
            self.to_coord.send(Slots(stage="codec", in_use=in_use))
            self._slots_reported = in_use


WARM_BATCHES = (1, 2, 4, 8)  # buckets captured ahead when no coalescing max_batch is given
WARM_CAPTURE_BUDGET_S = 180.0  # graph captures at start-up stop after this long (largest first)
# reference encodes at start-up, each a batch of clips of these many frames: a fused encoder's
# Triton kernels compile a variant per sequence length that is 1, a multiple of 16 or neither
# (at each stage's rate: 48 frames divide at every stage, 37 at none past the second) and per
# batch, so the first new voices do not wait for those compiles
WARM_ENCODE_FRAMES = ((48,), (37,), (37, 20))
FUSED_CHECK_FRAMES = 48  # a seeded noise clip encoded through both paths at start-up
FUSED_CHECK_AGREEMENT = 0.9  # share of its first-stage codes that must agree (a correct kernel
#                              differs from the plain path only at near ties; a broken one at random)


def check_fused_encoder(runner: Any) -> bool:
    """With the fused encoder on (`codec.fused_encoder`, CUDA), encode a seeded noise clip through
    its kernels and through the plain path, outside any graph: a launch that fails, or first-stage
    codes that agree on fewer than `FUSED_CHECK_AGREEMENT` of the frames, turns it off with a
    warning naming the setting (its kernels are compiled on the machine that serves, not where they
    were tested), so new voices are encoded, more slowly, rather than refused. Returns whether it
    stays on. Run before any reference encode, so no encode graph records the fused path first."""
    import torch

    model = getattr(runner, "model", None)
    if model is None or not model.fused_encoder:
        return False
    rng = np.random.default_rng(0)
    clip = 0.1 * rng.standard_normal((1, runner.channels, FUSED_CHECK_FRAMES * runner.samples_per_frame))
    wav = torch.from_numpy(clip.astype(np.float32)).to(runner.device)  # [1, C, S]
    try:
        fused = model.encode(wav, None, runner.n_vq).codes[0, 0]  # [T] first-stage codes
    except Exception as exc:  # noqa: BLE001 - any failure of the kernels' compile or launch
        reason = f"it failed ({type(exc).__name__}: {exc})"
    else:
        model.use_fused_encoder(False)
        plain = model.encode(wav, None, runner.n_vq).codes[0, 0]
        agree = (fused == plain).float().mean().item()
        if agree >= FUSED_CHECK_AGREEMENT:
            model.use_fused_encoder(True)
            log.info("codec: the fused reference encoder agrees with the plain path on %.1f%% of a test "
                     "clip's first-stage codes", 100 * agree)
            return True
        reason = (f"its first-stage codes agree with the plain path's on {agree:.0%} of a test clip's "
                  f"frames, under {FUSED_CHECK_AGREEMENT:.0%}")
    model.use_fused_encoder(False)
    log.warning("codec: the fused reference encoder is off on this device: %s; new voices are encoded "
                "through the plain path (set codec.fused_encoder=false to skip this check)", reason)
    return False


def warm_up(runner: Any, chunk_lengths: tuple[int, ...] = (), max_batch: int = max(WARM_BATCHES),
            capture_budget_s: float = WARM_CAPTURE_BUDGET_S, startup: StartupLog | None = None) -> None:
    """Decode and encode once so the first request does not pay for lazy set-up; with decode graphs,
    capture every batch bucket up to `max_batch` (the coalescing window's) for the schedule's chunk
    lengths (initial, ramp, steady) too, within the budget: a capture while serving stalls every
    stream for a device sync, a collection and three decodes (seen as multi-second coalescing
    waits on the H200 at C=128-256); then time a few replays to fit the dispatch planner's cost
    model. The fused encoder is checked against the plain path before the first reference
    encodes (`check_fused_encoder`). With encode graphs, their buckets are captured too. Each
    capture is a line every tenth or 10 s; the times go into `startup`'s phases (a log of its own
    when none is given)."""
    own = startup is None
    startup = startup or StartupLog("codec", log.info)
    try:
        with startup.phase("warm-up", "the first decode"):
            runner.open(-1)
            try:
                runner.decode([(-1, np.zeros((1, runner.n_vq), dtype=np.int64))])
            finally:
                runner.close(-1)
        capture = getattr(runner, "capture", None)
        if capture is not None and chunk_lengths:
            startup.capture("decode graphs", lambda progress: capture(range(1, max_batch + 1), chunk_lengths,
                                                                      capture_budget_s, progress))
            with startup.phase("warm-up", "the decode cost's calibration"):
                cost = runner.calibrate()
            if cost is not None:
                log.info("codec: decode call cost %.2f ms + %.3f ms per row + %.4f ms per row and frame",
                         cost.fixed_ms, cost.row_ms, cost.row_frame_ms)
        with startup.phase("warm-up", "the first reference encodes"):
            check_fused_encoder(runner)
            for frames in WARM_ENCODE_FRAMES:
                runner.encode([np.zeros((runner.channels, n * runner.samples_per_frame), dtype=np.float32)
                               for n in frames])
        capture_encode = getattr(runner, "capture_encode", None)
        if capture_encode is not None:
            startup.capture("reference-encode graphs", lambda progress: capture_encode(capture_budget_s, progress))
    finally:
        if own:
            startup.close()


def main(spec: WorkerSpec) -> None:
    """Process entry: load the codec, warm up, say Ready, loop until shutdown."""
    variant = prepare_process(spec, spec.profile.codec.torch_threads)
    if spec.profile.codec.priority_stream:
        use_priority_stream(spec.device)  # the decode loop's thread; the encoder thread keeps its own
    from_talker, from_coord, to_coord, to_clients = attach_codec(spec)
    timeline = open_timeline(spec.profile.engine.timeline_dir, f"codec{spec.replica}")
    gc_pauses: GcPauses | None = None
    startup = StartupLog("codec", log.info, spec.spawned_at)
    try:
        variant, plan = apply_memory_plan(spec, variant)
        with startup.phase("load", "the model's load") as span:
            runner = variant.make_codec_runner(spec.device)
        log.info("codec: loaded in %.1f s", span.seconds)
        warm_up(runner, chunk_lengths(spec.profile), spec.profile.coalescing.max_batch, startup=startup)
        frozen = freeze_heap()
        times = startup.times()
        log.info("codec: ready in %s (%d objects frozen out of garbage collection)", describe(times), frozen)
        gc_pauses = GcPauses("codec")  # a long collection goes to the log
        to_coord.send(Ready(stage="codec", pid=os.getpid(), capacity=runner.max_slots,
                            memory=memory_report("codec", plan, spec.device), startup=times))
        c = spec.profile.coalescing
        coalescer = Coalescer(min_batch=c.min_batch, max_wait_s=c.max_wait_ms / 1000.0,
                              max_batch=c.max_batch, policy=c.policy)
        loop = CodecLoop(runner, from_talker, from_coord, to_coord, to_clients, coalescer,
                         spec.profile.codec.encode_batch,
                         client_stall_s=spec.profile.codec.client_stall_s, timeline=timeline,
                         express_first_chunks=c.express_first_chunks,
                         express_joins_dispatch=c.express_joins_dispatch,
                         patient_wait_s=c.patient_wait_ms / 1000.0,
                         buffer_margin_s=c.buffer_margin_ms / 1000.0,
                         final_wait_s=None if c.final_wait_ms is None else c.final_wait_ms / 1000.0,
                         encode_batch_streaming=spec.profile.codec.encode_batch_streaming,
                         encode_batch_samples=encode_batch_samples(spec.profile, runner.sample_rate),
                         kernels=triton_kernel_counter(spec.device), setup=spec.setup,
                         rings=CodecRings(spec), beat_s=beat_interval(spec.profile))
        loop.run()
        loop.encoder.close()
        from_talker = loop.from_talker  # the rings open now (a replaced peer's), closed below
    except Exception as exc:
        log.exception("codec worker failed")
        to_coord.send(StageError(stage="codec", message=f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        startup.close()
        if gc_pauses is not None:
            gc_pauses.close()
        thaw_heap()
        if timeline is not None:
            timeline.close()
        for ch in (from_talker, from_coord, to_coord, *to_clients):
            if ch is not None:
                ch.close()
