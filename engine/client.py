"""`EngineClient`: the engine as seen from one API process (or the offline API).

`generate(job)` builds the request here, in the caller's process (the variant's request adapter:
prompt, sampling, priming), submits it with its rows as raw payload, and yields `AudioChunk`s as
the codec worker's PCM records arrive on this client's own ring. Closing or cancelling the iterator before its final
chunk sends `Abort`, which the coordinator forwards to both workers.

Reader tasks (coordinator → client control, and one per replica for codec → client data) route
records by request id into per-request mailboxes whose `put` never awaits. A dead coordinator
fails every open request with `EngineFailed` and makes `healthy()` false; a codec dying is the
coordinator's to report (it fails that replica's requests with `Failed`). When a replica is
restarted, its new codec's PCM ring arrives on the `rewire` pipe and replaces the old one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np

from engine.counters import CounterBlock
from engine.open_speech import OpenSpeech
from engine.outbox import Outbox
from ipc.channel import Channel, ChannelSpec
from ipc.errors import EndOfStream, PeerGone, RingClosed
from ipc.messages import Abort, Codes, EncodeRequest, EncodeResult, Failed, PcmChunk, Rejected, Submit
from ipc.peer import Peer
from profiles import Profile
from speech.job import SpeechJob
from stages.variant import TalkerRequest, Variant
from stages.workers.timeline import Timeline, open_timeline

log = logging.getLogger(__name__)

ID_SHIFT = 40  # request ids: client_index << 40 | generation << 32 | counter
GENERATION_SHIFT = 32  # a replaced API process's ids never meet its predecessor's


@dataclass
class AudioChunk:
    """A piece of a request's audio. The last one has `final=True` (its PCM may be empty)."""

    pcm: np.ndarray            # float32 [samples, channels]
    final: bool
    finish_reason: str | None  # "stop" | "length" on the final chunk
    batch_size: int = 0        # streams the codec decoded together with this chunk (0: none)
    coalesce_wait_s: float = 0.0  # time this chunk waited in the codec's coalescing window
    codes: np.ndarray | None = None  # [T, n_vq] int64 this audio was decoded from (`echo_codes`)


class EngineRejected(Exception):
    """Admission refused the request (queue full or shutting down): HTTP 429/503 + Retry-After."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(f"{reason} (retry after {retry_after_s:g} s)")
        self.reason = reason
        self.retry_after_s = retry_after_s


class EngineFailed(Exception):
    """The request could not complete: a worker died, its deadline passed, or an internal error.
    `reason` says which (`ipc.messages.FailReason`): "worker_lost", "engine_failed" and
    "shutdown" mean the engine could not serve it (HTTP 503 before any audio), "deadline" its
    time ran out, "error" a fault of this request."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason

    @property
    def unavailable(self) -> bool:
        """The engine could not serve the request (not the request's own fault): retry later."""
        return self.reason in ("worker_lost", "engine_failed", "shutdown")


@dataclass(frozen=True)
class ClientSpec:
    """Picklable: what a spawned API process needs to build its `EngineClient` (`connect`)."""

    index: int
    variant: type[Variant]       # pickled by reference: its module is imported in the API process
    model_dir: str
    profile: Profile
    to_coord: ChannelSpec
    from_coord: ChannelSpec
    from_codecs: tuple[ChannelSpec | None, ...]  # one PCM ring per replica's codec worker (None:
    #                                              that codec is being replaced; see `rewire`)
    counters_name: str
    counters_hist: int
    counters_replicas: int = 1
    watch_pids: tuple[int, ...] = ()   # the coordinator: healthy() is false once it exits
    rewire: Any = None  # Connection: (replica, ChannelSpec) of a restarted codec's PCM ring
    generation: int = 0  # this slot's n-th process (a replaced one): its request ids differ


class _Mailbox:
    """One request's inbox: `put` never awaits; `get` waits for the next item."""

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.event = asyncio.Event()

    def put(self, item: Any) -> None:
        self.items.append(item)
        self.event.set()

    async def get(self) -> Any:
        while not self.items:
            self.event.clear()
            await self.event.wait()
        return self.items.popleft()


class SubmittedSpeech:
    """A submitted request's chunks: an async iterator of `AudioChunk`. `aclose()` aborts the
    request unless it finished, whether it was iterated or not (closing a generator never
    started runs nothing, so an abort would otherwise be left to nobody)."""

    def __init__(self, chunks: AsyncIterator[AudioChunk], forget: Any) -> None:
        self._chunks, self._forget, self._started = chunks, forget, False

    def __aiter__(self) -> SubmittedSpeech:
        return self

    def __anext__(self) -> Any:
        self._started = True
        return self._chunks.__anext__()

    async def aclose(self) -> None:
        never_started, self._started = not self._started, True
        await self._chunks.aclose()  # a later __anext__ finds it closed
        if never_started:
            self._forget()


def fit_kv_cache(request: TalkerRequest, rows: int) -> TalkerRequest:
    """`request` as one talker KV cache of `rows` rows can serve it alone: its frame budget cut to
    the rows its prompt leaves (it then finishes with "length", never fails for room); ValueError
    when the prompt and its forced frames (or a first frame) do not fit at all."""
    prompt, sampling = len(request.prompt), request.sampling
    need = prompt + (sampling.forced_frames or 1)
    if need > rows:
        raise ValueError(f"the input (with its reference) makes a prompt of {prompt} rows"
                         + (f" to be followed by {sampling.forced_frames} frames" if sampling.forced_frames else "")
                         + f", and the talker's KV cache holds at most {rows} rows; shorten the input or "
                         "the reference audio")
    if prompt + sampling.max_new_frames <= rows:
        return request
    return replace(request, sampling=msgspec.structs.replace(sampling, max_new_frames=rows - prompt))


class EngineClient:
    """One per API process; see the module docstring. Use `connect(spec)` or the engine handle."""

    def __init__(self, index: int, variant: Variant, to_coord: Channel, from_coord: Channel,
                 from_codecs: list[Channel], counters: CounterBlock,
                 watch_pids: tuple[int, ...] = (), rewire: Any = None,
                 timeline: Timeline | None = None, generation: int = 0) -> None:
        self.index = index
        self.variant = variant
        self.sample_rate: int = variant.sample_rate
        self.channels: int = variant.channels
        self.n_vq: int = variant.n_vq
        self.model_name: str = variant.name
        self._to_coord = to_coord
        self._from_coord, self._from_codecs = from_coord, list(from_codecs)
        self._rewire = rewire
        self._codec_readers: list[asyncio.Task | None] = [None] * len(self._from_codecs)
        self._outbox: Outbox | None = None
        self._counters = counters
        self._ids = itertools.count((generation << GENERATION_SHIFT) + 1)
        self._boxes: dict[int, _Mailbox] = {}
        self._readers: list[asyncio.Task] = []
        self._dead: str | None = None
        self._peers = [Peer(pid) for pid in watch_pids]
        self._route_s = 0.0  # time spent taking records off this client's rings
        # submits and PCM arrivals by request id (`engine.timeline_dir`): with the workers'
        # timelines, where a request's time goes between this process and the engine
        self._timeline = timeline

    @classmethod
    def connect(cls, spec: ClientSpec) -> EngineClient:
        """Open this API process's channels and counters (call once, in the API process); the
        request path is warmed (`Variant.warm_request_path`) before the first request comes."""
        variant = spec.variant(spec.model_dir, spec.profile)
        variant.warm_request_path()
        return cls(spec.index, variant, spec.to_coord.open(), spec.from_coord.open(),
                   [None if codec is None else codec.open() for codec in spec.from_codecs],
                   CounterBlock.attach(spec.counters_name, spec.counters_hist,
                                       spec.counters_replicas), spec.watch_pids, spec.rewire,
                   open_timeline(spec.profile.engine.timeline_dir, f"client{spec.index}"),
                   spec.generation)

    # ---- the interface -------------------------------------------------------------------------

    async def generate(self, job: SpeechJob, *, echo_codes: bool = False) -> AsyncIterator[AudioChunk]:
        """Stream `job`'s audio. Raises `EngineRejected`, `EngineFailed`, or `ValueError` (bad
        job fields, before anything is submitted). With `echo_codes` every chunk also carries the
        codes it was decoded from (`AudioChunk.codes`). Submits on the first `anext`."""
        async with contextlib.aclosing(self.start(job, echo_codes=echo_codes)) as chunks:
            async for chunk in chunks:
                yield chunk

    def start(self, job: SpeechJob, *, echo_codes: bool = False) -> SubmittedSpeech:
        """`generate`, with `job` submitted now, before the caller's next await: its first chunk
        does not wait for a turn of the event loop behind every other request's work (a first
        wave lands 16 requests on one API process at once). `ValueError` (bad job fields) or
        `EngineFailed` here, before anything is submitted; `EngineRejected` from the chunks. The
        caller must `aclose()` what it gets unless it iterates it to the end."""
        request = self.variant.build_request(job)  # prompt [S, 1 + n_vq], sampling, priming
        rid, box = self._submit(request, job, echo_codes=echo_codes)
        return SubmittedSpeech(self._receive(rid, box), lambda: self._forget(rid))

    def open_speech(self, job: SpeechJob, *, held: bool = False) -> OpenSpeech:
        """A request whose text arrives while it speaks (`engine.open_speech.OpenSpeech`: `push`,
        `end`, `chunks()`); for variants that `takes_text_while_speaking`. `job.text` is ignored;
        `AdapterError` (a ValueError) for fields the variant cannot serve. `held`: not submitted
        before `release()`."""
        return OpenSpeech(self, self.variant.open_text_stream(job), job, held=held)

    def _submit(self, request: TalkerRequest, job: SpeechJob, *, echo_codes: bool = False,
                open_input: bool = False) -> tuple[int, _Mailbox]:
        """Send `request` (`fit_kv_cache` of the smallest KV cache any replica reported: a
        ValueError before anything is sent when it could never fit)."""
        limit = int(self._counters["max_prompt_rows"])
        if limit:
            request = fit_kv_cache(request, limit)
        self._check_alive()
        rid, box = self._open_mailbox()
        self._send(Submit(rid=rid, client=self.index, sampling=request.sampling,
                          initial_chunk_frames=job.initial_chunk_frames,
                          prime_frames=request.prime_frames, echo_codes=echo_codes,
                          open_input=open_input), request.payload())
        if self._timeline is not None:  # the API process's marks, where it gave them
            marks = {name: t for name, t in (("received", job.received_at), ("parsed", job.parsed_at),
                                              ("loaded", job.loaded_at), ("voiced", job.voice_at))
                     if t is not None}
            self._timeline.add("client_submit", time.monotonic(), rid=rid, **marks)
        return rid, box

    async def _receive(self, rid: int, box: _Mailbox) -> AsyncIterator[AudioChunk]:
        """Request `rid`'s chunks as they arrive; closing it early sends `Abort`. With a timeline,
        the first chunk's way through this process: taken by the request (`client_first_taken`)
        and, when the request asks for the next one, handled (`client_first_out`: encoded and
        handed to the HTTP server)."""
        finished = False
        codes = None
        first = self._timeline is not None
        try:
            while True:
                item = await box.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, np.ndarray):  # the codes of the chunk that follows
                    codes = item if codes is None else np.concatenate([codes, item])
                    continue
                if codes is not None:
                    item.codes, codes = codes, None
                if item.final:
                    finished = True
                if first:
                    self._timeline.add("client_first_taken", time.monotonic(), rid=rid)
                yield item
                if first:
                    self._timeline.add("client_first_out", time.monotonic(), rid=rid)
                    first = False
                if finished:
                    return
        finally:
            if finished:
                self._boxes.pop(rid, None)
            else:
                self._forget(rid)

    def _forget(self, rid: int) -> None:
        """Nobody reads request `rid` any more: drop its mailbox and abort it in both workers."""
        self._boxes.pop(rid, None)
        if self._dead is None:
            self._send(Abort(rid=rid))

    async def encode_reference(self, wav: np.ndarray) -> np.ndarray:
        """Reference waveform `[channels, samples]` float32 at the codec rate (prepared by the
        processor) → codes `[T, n_vq]` int64, encoded on the codec worker (batched there)."""
        wav = np.ascontiguousarray(wav, dtype=np.float32)
        if wav.ndim != 2 or wav.shape[0] != self.channels:
            raise ValueError(f"reference waveform must be [{self.channels}, samples], "
                             f"got {list(wav.shape)}")
        self._check_alive()
        job, box = self._open_mailbox()
        sent = time.monotonic()
        try:
            self._send(EncodeRequest(job=job, client=self.index), wav)
            item = await box.get()
        finally:
            self._boxes.pop(job, None)
        if self._timeline is not None:  # sent to the codec worker, and its codes (or error) back
            self._timeline.add("client_encode", sent, dur=time.monotonic() - sent)
        if isinstance(item, BaseException):
            raise item
        return item

    def healthy(self) -> bool:
        """The coordinator is alive and the engine has not failed (a replica is up, or one is
        being restarted)."""
        return (self._dead is None and self._counters["healthy"] == 1
                and all(peer.alive() for peer in self._peers))

    def ready(self) -> bool:
        return self.healthy() and self._counters["ready"] == 1

    def counters(self) -> dict:
        """Engine counters (shared block) plus this client's own ring bytes and open requests;
        `healthy` and `ready` are this client's `healthy()` and `ready()` (so a scrape agrees
        with `/health` and `/ready`, also when the coordinator itself is gone)."""
        snap = self._counters.snapshot()
        snap["healthy"], snap["ready"] = float(self.healthy()), float(self.ready())
        own = sum(ch.statistics().used_bytes for ch in (self._from_coord, *self._from_codecs)
                  if ch is not None and not ch.closed)
        snap["client_ring_bytes"] = own
        snap["client_open"] = len(self._boxes)
        snap["client_route_s"] = self._route_s
        return snap

    async def close(self) -> None:
        """Stop the readers and close this client's channel ends. Records already in its rings
        are delivered first (a drained request whose last chunk the codec wrote before the
        engine stopped ends normally); the requests still open then fail."""
        tasks = [*self._readers, *(t for t in self._codec_readers if t is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._readers.clear()
        for channel in (self._from_coord, *self._from_codecs):
            if channel is not None:
                self._deliver_waiting(channel)
        if self._rewire is not None and not self._rewire.closed:
            with contextlib.suppress(ValueError, RuntimeError):  # loop closed or never added
                asyncio.get_running_loop().remove_reader(self._rewire.fileno())
            self._rewire.close()
        if self._outbox is not None:
            self._outbox.close()
        self._fail_all("engine client closed", "shutdown")
        for ch in (self._to_coord, self._from_coord, *self._from_codecs):
            if ch is not None:
                ch.close()
        self._counters.close()
        for peer in self._peers:
            peer.close()
        if self._timeline is not None:
            self._timeline.close()

    # ---- plumbing ------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineFailed(self._dead, "engine_failed")
        if not self._readers:
            loop = asyncio.get_running_loop()
            self._outbox = Outbox(self._to_coord, f"client{self.index}->coordinator")
            self._readers = [loop.create_task(self._read(self._from_coord, "coordinator"))]
            if self._rewire is not None:
                self._take_rewires()  # restarts that happened before this client's first request
                loop.add_reader(self._rewire.fileno(), self._take_rewires)
            for k in range(len(self._from_codecs)):
                if self._codec_readers[k] is None and self._from_codecs[k] is not None:
                    self._start_codec_reader(k)

    def _start_codec_reader(self, replica: int) -> None:
        ring = self._from_codecs[replica]
        self._codec_readers[replica] = asyncio.get_running_loop().create_task(
            self._read(ring, f"codec of replica {replica}"))

    def _take_rewires(self) -> None:
        """Open every restarted codec's PCM ring waiting on the rewire pipe, in order."""
        while self._rewire.poll():
            try:
                replica, spec = self._rewire.recv()
                channel = spec.open()
            except (EOFError, OSError) as exc:  # the engine is stopping
                log.info("engine client %d: rewire pipe closed (%s)", self.index, exc)
                asyncio.get_running_loop().remove_reader(self._rewire.fileno())
                return
            except Exception as exc:  # that codec is already gone again
                log.warning("engine client %d: cannot open a restarted codec's ring: %s",
                            self.index, exc)
                continue
            old, self._from_codecs[replica] = self._from_codecs[replica], channel
            task = self._codec_readers[replica]
            if old is None:
                pass
            elif task is None or task.done():
                old.close()
            else:  # close the old ring once its reader has stopped using it
                task.add_done_callback(lambda _, old=old: old.close())
                task.cancel()
            self._start_codec_reader(replica)
            log.info("engine client %d: replica %d's new codec ring attached", self.index, replica)

    def _open_mailbox(self) -> tuple[int, _Mailbox]:
        rid = (self.index << ID_SHIFT) | next(self._ids)
        box = self._boxes[rid] = _Mailbox()
        return rid, box

    def _send(self, msg: Any, payload: Any = None) -> None:
        assert self._outbox is not None
        if not self._outbox.put(msg, payload):
            self._on_gone("coordinator", self._outbox.broken)

    async def _read(self, channel: Channel, source: str) -> None:
        while True:
            try:
                rec = await channel.recv_async()
            except (PeerGone, EndOfStream, RingClosed) as exc:
                if channel is not self._from_coord:  # the coordinator fails its requests
                    log.warning("engine client %d: the %s is gone (%s)", self.index, source, exc)
                    return
                self._on_gone(source, exc)
                return
            t0 = time.perf_counter()
            try:
                self._route(rec.msg, rec)
            except Exception:  # a routing bug must not silently stop this reader
                log.exception("client %d: routing %r failed", self.index, rec.msg)
            finally:
                rec.release()
            self._route_s += time.perf_counter() - t0

    def _deliver_waiting(self, channel: Channel) -> None:
        """Route the records in `channel` now, without waiting for more (the readers stopped)."""
        if channel.closed:
            return
        while True:
            try:
                rec = channel.try_recv()
            except Exception as exc:  # a peer that died mid-record: nothing more to deliver
                log.info("engine client %d: closing with records left unread (%s)", self.index, exc)
                return
            if rec is None:
                return
            try:
                self._route(rec.msg, rec)
            except Exception:
                log.exception("client %d: routing %r failed", self.index, rec.msg)
            finally:
                rec.release()

    def _route(self, msg: Any, rec: Any) -> None:
        match msg:
            case PcmChunk(rid=rid):
                if self._timeline is not None:
                    self._timeline.add("client_pcm", time.monotonic(), rid=rid, seq=msg.seq, final=msg.final)
                box = self._boxes.get(rid)
                if box is not None:  # else: aborted, nobody listens
                    planar = rec.array(np.float32).reshape(self.channels, -1)  # ring view
                    pcm = np.ascontiguousarray(planar.T)  # [samples, channels], owned
                    box.put(AudioChunk(pcm=pcm, final=msg.final, finish_reason=msg.finish_reason,
                                       batch_size=msg.batch_size, coalesce_wait_s=msg.waited_s))
            case Codes(rid=rid):
                box = self._boxes.get(rid)
                if box is not None:
                    box.put(rec.array(np.int64).reshape(-1, self.n_vq).copy())
            case EncodeResult(job=job, error=error):
                box = self._boxes.get(job)
                if box is not None:
                    if error is not None:
                        box.put(EngineFailed(f"reference encoding failed: {error}"))
                    else:
                        box.put(rec.array(np.int64).reshape(-1, self.n_vq).copy())
            case Rejected(rid=rid, reason=reason, retry_after_s=retry):
                box = self._boxes.get(rid)
                if box is not None:
                    box.put(EngineRejected(reason, retry))
            case Failed(rid=rid, message=message, reason=reason):
                box = self._boxes.get(rid)
                if box is not None:
                    box.put(EngineFailed(message, reason))
            case _:
                log.error("client %d: unexpected record %r", self.index, msg)

    def _on_gone(self, source: str, exc: BaseException | None) -> None:
        if self._dead is None:
            self._dead = f"the {source} is gone ({exc})"
            report = log.error if self._boxes else log.info
            report("engine client %d: %s", self.index, self._dead)
        self._fail_all(self._dead, "engine_failed")

    def _fail_all(self, message: str, reason: str) -> None:
        for box in self._boxes.values():
            box.put(EngineFailed(message, reason))
