"""``POST /v1/audio/speech``: streamed files (the default), whole files and SSE, in every format.

Without ``stream_format`` the file's bytes go out as they are made (chunked transfer, one
container per response), as OpenAI's endpoint does; ``stream: false`` (and flac, unless streamed
on request) sends the whole file at once, with its finish reason and usage in the headers. The
first audio chunk is awaited before the response starts, so admission rejections and bad sampling
values still get their HTTP status; after that, audio is encoded and sent as it arrives. A client
that disconnects aborts its engine request (closing the chunk iterator does that). An engine
failure after audio went out ends the stream visibly: an SSE error event, or a cut raw stream (the
connection closes without the final chunk), and is logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from api import sse
from api.audio_encoding import AudioEncoder, FFmpegUnavailable, make_encoder
from api.errors import ApiError, bad_request
from api.fields import FieldReport, screen_fields
from api.json_body import read_json_body
from api.schemas import SpeechRequest, decode_speech_request
from api.send_limits import Hold
from api.speech_job import OutputPlan, check_request, output_plan, resolve_voice, sampling_overrides
from api.streaming import AudioStreamResponse, ClientGone, StreamCut, WholeAudioResponse, run_until_disconnect
from engine.client import EngineFailed, EngineRejected, SubmittedSpeech
from speech.job import SpeechJob

log = logging.getLogger("mossvox.api")


class RequestTracker:
    """Per-request timing, outcome and usage, recorded into the process's metrics once."""

    def __init__(self, metrics, sample_rate: int, started: float, *, samples_per_frame: int = 0) -> None:
        self.metrics = metrics
        self.sample_rate = sample_rate
        self.samples_per_frame = samples_per_frame
        self.started = started
        self.samples = 0  # model samples per channel received from the engine
        self.encoder: AudioEncoder | None = None  # what the file holds, once it is being encoded
        self.out_rate = sample_rate
        self.finish_reason: str | None = None
        self.last_chunk: float | None = None
        self.first_audio: float | None = None
        self.submitted: float | None = None  # body parsed and the voice resolved: handed to the engine
        self.done = False
        self.request_id = f"speech-{uuid.uuid4().hex[:16]}"
        self.received_at = time.monotonic()  # the engine timelines' clock (`SpeechJob.received_at`)
        self.parsed_at: float | None = None  # the same clock: the body read and validated
        self.loaded_at: float | None = None  # ... its reference clips fetched and decoded
        self.voice_at: float | None = None  # ... and the voice's reference codes resolved

    def chunk(self, chunk) -> None:
        now = time.perf_counter()
        if self.last_chunk is not None:
            self.metrics.chunk_interval.observe(now - self.last_chunk)
        self.last_chunk = now
        self.samples += chunk.pcm.shape[0]
        if chunk.final:
            self.finish_reason = chunk.finish_reason
        if getattr(chunk, "batch_size", 0):  # this chunk went through a codec decode batch
            self.metrics.coalesce_wait.observe(chunk.coalesce_wait_s)

    def sent_audio(self) -> None:
        if self.first_audio is None:
            self.first_audio = time.perf_counter()
            self.metrics.ttfa.observe(self.first_audio - self.started)

    @property
    def audio_seconds(self) -> float:
        """Seconds of audio in the response (after ``speed``)."""
        if self.encoder is not None:
            return self.encoder.samples / self.out_rate
        return self.samples / self.sample_rate

    @property
    def frames(self) -> int:
        """Frames (audio tokens) the model generated for the response."""
        return self.samples // self.samples_per_frame if self.samples_per_frame else 0

    def usage(self, text: str) -> dict:
        """The usage record of SSE ``done`` events and batch items."""
        return {"input_characters": len(text), "output_tokens": self.frames, "output_frames": self.frames,
                "audio_seconds": round(self.audio_seconds, 4)}

    def usage_headers(self, text: str) -> dict[str, str]:
        """Finish reason and usage of a whole response, as headers."""
        return {"X-Finish-Reason": self.finish_reason or "stop", "X-Audio-Seconds": f"{self.audio_seconds:.3f}",
                "X-Output-Tokens": str(self.frames), "X-Input-Characters": str(len(text))}

    def finish(self, outcome: str, reason: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        elapsed = time.perf_counter() - self.started
        if reason is not None:
            log.info("%s %s after %.2f s: %s", self.request_id, outcome, elapsed, reason)
        else:
            first = f"{1000 * (self.first_audio - self.started):.0f} ms" if self.first_audio else "-"
            prep = f"{1000 * (self.submitted - self.started):.0f} ms" if self.submitted else "-"
            log.info("%s %s: %.2f s of audio in %.2f s, first audio %s (request + voice preparation %s)",
                     self.request_id, outcome, self.audio_seconds, elapsed, first, prep)
        self.metrics.requests.labels(outcome=outcome).inc()
        if self.samples:
            self.metrics.audio_seconds.inc(self.audio_seconds)
        if outcome == "ok" and self.samples and self.audio_seconds:
            self.metrics.rtf.observe((time.perf_counter() - self.started) / self.audio_seconds)


def new_tracker(state) -> RequestTracker:
    """A tracker for one request served by ``state``'s engine client."""
    client = state.client
    return RequestTracker(state.metrics, client.sample_rate, time.perf_counter(),
                          samples_per_frame=client.variant.samples_per_frame)


async def create_speech(request: Request) -> Response:
    return await tracked(request, _create_speech)


async def tracked(request: Request, respond) -> Response:
    """``respond(request, state, tracker)``'s response, its outcome recorded once: a refusal
    (``ApiError``) re-raised for the error handler, a client gone answered 499, a bug a 500."""
    state = request.state.api
    tracker = new_tracker(state)
    try:
        return await respond(request, state, tracker)
    except ApiError as exc:
        tracker.finish(outcome_of(exc), reason=f"{exc.status} {exc.message}")
        raise
    except (ClientGone, ClientDisconnect):
        tracker.finish("cancelled")  # the client left (mid-body, or while waiting): not a failure
        return Response(status_code=499)  # nobody is listening; the engine request was aborted
    except Exception as exc:  # a bug: answer it as one (logged, counted as failed), keep serving
        log.exception("%s: unexpected error", tracker.request_id)
        tracker.finish("failed")
        raise ApiError(500, f"Internal server error ({type(exc).__name__})") from None
    except BaseException:
        tracker.finish("cancelled")
        raise


def outcome_of(exc: ApiError) -> str:
    """The metrics outcome of a request that ended with ``exc``."""
    return "rejected" if exc.status in (429, 503) else "failed" if exc.status >= 500 else "client_error"


@dataclass
class Started:
    """A request handed to the engine: its first chunk is in, the rest to come from ``chunks``."""

    plan: OutputPlan
    encoder: AudioEncoder
    first: object  # the first AudioChunk, or None when the stream ended at once
    chunks: AsyncIterator
    headers: dict[str, str]
    fields: FieldReport  # the fields the model ignored: every response kind reports them


async def start_speech(req: SpeechRequest, state, tracker: RequestTracker, receive, *,
                       whole: bool = False, plan: OutputPlan | None = None,
                       ignored: tuple[str, ...] = ()) -> Started:
    """Check ``req``, resolve its voice, submit it and wait for its first chunk (``ApiError`` on
    any refusal, nothing left running). ``whole`` sends the file at once whatever ``req`` asks.
    ``receive`` (the ASGI one) stops the wait when the client leaves; ``None`` leaves that to
    the caller. ``plan`` replaces the output that ``req`` asks for (another API's formats);
    ``ignored`` names the caller's own fields that nothing uses, reported with ``req``'s."""
    client = state.client
    check_request(req, model_names=state.model_names, limits=state.limits, sample_rate=client.sample_rate)
    if plan is None:
        plan = output_plan(req, native_rate=client.sample_rate, native_channels=client.channels,
                           pcm_layout=state.profile.api.pcm_layout)
    if whole:
        plan = dataclasses.replace(plan, mode="file")
    req, fields = screen_fields(req, client.variant, strict=state.profile.api.strict_fields)
    if ignored:
        fields = dataclasses.replace(fields, ignored=(*fields.ignored, *ignored))
    if fields.ignored:
        log.debug("%s: %s does not use %s; ignored", tracker.request_id, client.model_name,
                  ", ".join(fields.ignored))
    if not client.ready():
        raise ApiError(503, "The engine is not ready yet", code="not_ready",
                       headers={"Retry-After": "1"})
    resolving = resolve_voice(req, state, tracker)
    # a reference's fetch, decode or encode is not waited for once the client has left
    voice = await (_until_disconnect(resolving, receive) if req.ref_audio is not None else resolving)
    tracker.voice_at = time.monotonic()
    job = SpeechJob(text=req.input, language=req.language, instructions=req.instructions,
                    ref_codes=voice.codes, ref_text=voice.ref_text, extra_ref_codes=list(voice.extra_codes),
                    sampling=sampling_overrides(req),
                    initial_chunk_frames=req.initial_codec_chunk_frames, forced_frames=req.forced_frames,
                    received_at=tracker.received_at, parsed_at=tracker.parsed_at, loaded_at=tracker.loaded_at,
                    voice_at=tracker.voice_at)
    try:
        encoder = make_encoder(plan.response_format, client.sample_rate, client.channels,
                               streaming=plan.mode != "file", speed=plan.speed, out_rate=plan.sample_rate,
                               out_channels=plan.channels, bit_rate=plan.bit_rate)
    except ValueError as exc:
        raise bad_request(str(exc), param="response_format") from None
    except FFmpegUnavailable as exc:
        raise ApiError(501, str(exc), param="response_format", code="format_unavailable") from None
    tracker.encoder, tracker.out_rate = encoder, plan.sample_rate
    tracker.submitted = time.perf_counter()
    chunks = _submit(client, job)
    try:
        first = await _until_disconnect(_first_chunk(chunks), receive)
    except BaseException:
        await chunks.aclose()  # the client left, or the engine refused it: nothing left running
        raise
    headers = {"X-Request-Id": tracker.request_id, "X-Audio-Sample-Rate": str(plan.sample_rate),
               "X-Audio-Channels": str(plan.channels), "X-Audio-Format": plan.response_format,
               "Cache-Control": "no-store", "X-Api-Process": str(os.getpid())}
    if voice.cache_hit is not None:
        headers["X-Ref-Cache"] = "hit" if voice.cache_hit else "miss"
    headers.update(fields.headers())
    return Started(plan, encoder, first, chunks, headers, fields)


@dataclass
class OutputCap:
    """The most audio one answer may hold (a whole file, or a batch's files together)."""

    max_bytes: int
    limit: str  # its profile field
    used: int = 0


async def whole_file(started: Started, tracker: RequestTracker, receive, *, hold: Hold, cap: OutputCap) -> bytes:
    """The rest of a started request encoded as one file (``ApiError`` 500 if the engine fails),
    its bytes held in ``hold`` (503 once the process holds ``api.max_held_audio_bytes``) and
    counted in ``cap`` (413 past it); on any failure both are given back."""
    return await _until_disconnect(
        _whole_file(started.first, started.chunks, started.encoder, tracker, tracker.request_id, hold, cap),
        receive)


async def whole_answer(started: Started, tracker: RequestTracker, receive, state) -> tuple[bytes, Hold]:
    """A started request's whole file within the send limits (at most
    ``api.max_stream_buffer_bytes``), and what it holds: give that to the response
    (``WholeAudioResponse(..., holds=(hold,))``), which gives it back once sent."""
    limits = state.send_limits
    hold = Hold(limits.held)
    body = await whole_file(started, tracker, receive, hold=hold,
                            cap=OutputCap(limits.max_buffered, "api.max_stream_buffer_bytes"))
    return body, hold


async def _until_disconnect(work, receive):
    return await (work if receive is None else run_until_disconnect(work, receive))


async def _create_speech(request: Request, state, tracker: RequestTracker) -> Response:
    req = decode_speech_request(await read_json_body(request))
    tracker.parsed_at = time.monotonic()
    started = await start_speech(req, state, tracker, request.receive)
    plan, encoder, headers = started.plan, started.encoder, started.headers
    limits = state.send_limits
    if plan.mode == "file":
        body, hold = await whole_answer(started, tracker, request.receive, state)
        headers.update(tracker.usage_headers(req.input))
        return WholeAudioResponse(body, media_type=encoder.content_type, headers=headers, limits=limits,
                                  holds=(hold,))
    if plan.mode == "sse":
        body_iter = _sse_stream(started.first, started.chunks, encoder, tracker, tracker.request_id, req.input,
                                plan.response_format, plan.sample_rate, plan.channels, started.fields)
        return AudioStreamResponse(body_iter, media_type=sse.CONTENT_TYPE, headers=headers, limits=limits)
    body_iter = raw_stream(started.first, started.chunks, encoder, tracker, tracker.request_id)
    return AudioStreamResponse(body_iter, media_type=encoder.content_type, headers=headers, limits=limits)


async def _encode(encoder: AudioEncoder, pcm) -> bytes:
    """Codec work (mp3 is ~30 ms per second of stereo audio) runs in a thread so the loop keeps
    serving other streams; cheap PCM/WAV packing stays inline. Calls stay in order per request."""
    if encoder.heavy:
        return await asyncio.to_thread(encoder.encode, pcm)
    return encoder.encode(pcm)


async def _finish(encoder: AudioEncoder) -> bytes:
    return await asyncio.to_thread(encoder.finish) if encoder.heavy else encoder.finish()


def _submit(client, job: SpeechJob) -> SubmittedSpeech:
    """``job`` submitted at once (``EngineClient.start``), its refusals as HTTP statuses."""
    try:
        return client.start(job)
    except ValueError as exc:  # the variant's request adapter refused a field
        raise bad_request(str(exc)) from None
    except EngineFailed as exc:
        raise engine_error(exc) from None


def engine_error(exc: EngineFailed) -> ApiError:
    """An engine failure before any audio went out, as the client expects it: 503 with
    `Retry-After` when the engine could not serve the request (a worker died or hung and is being
    replaced, the engine failed or stops, its deadline passed under load); 500 only for a fault
    of this request itself."""
    if exc.unavailable or exc.reason == "deadline":
        return ApiError(503, f"The engine could not serve this request now: {exc}",
                        code="engine_unavailable", headers={"Retry-After": "1"})
    return ApiError(500, f"The engine failed this request: {exc}")


async def _first_chunk(chunks: AsyncIterator):
    """The first chunk, with engine errors turned into HTTP statuses (nothing was sent yet; the
    caller closes ``chunks``)."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None
    except EngineRejected as exc:
        retry = str(max(1, math.ceil(exc.retry_after_s or 1)))
        status = 503 if _is_unavailable(exc.reason) else 429
        raise ApiError(status, f"Request rejected by admission: {exc.reason}", code="overloaded",
                       headers={"Retry-After": retry}) from None
    except EngineFailed as exc:
        raise engine_error(exc) from None


def _is_unavailable(reason: str | None) -> bool:
    text = (reason or "").lower()
    return any(word in text for word in ("ready", "unhealthy", "shutting", "stopp", "draining", "dead"))


async def _all_chunks(first, chunks: AsyncIterator) -> AsyncIterator:
    if first is not None:
        yield first
    async for chunk in chunks:
        yield chunk


async def _whole_file(first, chunks: AsyncIterator, encoder: AudioEncoder, tracker: RequestTracker,
                      request_id: str, hold: Hold, cap: OutputCap) -> bytes:
    pieces: list[bytes] = []
    made = 0  # bytes of the file so far: returned by the encoder, or held in it until finish
    mine = 0  # of cap.used and of hold

    def keep(piece: bytes) -> None:
        nonlocal made, mine
        pieces.append(piece)
        made += len(piece)
        more = made + encoder.held_bytes - mine
        if more <= 0:
            return
        if not hold.add(more):
            raise ApiError(503, "The server holds too much audio for its clients right now "
                                "(api.max_held_audio_bytes); try again shortly, or stream the response",
                           code="overloaded", headers={"Retry-After": "1"}, limit="api.max_held_audio_bytes")
        mine += more
        cap.used += more
        if cap.used > cap.max_bytes:
            raise ApiError(413, f"The answer would hold more than {cap.max_bytes} bytes of audio ({cap.limit}); "
                                f"ask for less audio, or stream it", code="response_too_large", limit=cap.limit)

    try:
        async for chunk in _all_chunks(first, chunks):
            tracker.chunk(chunk)
            keep(await _encode(encoder, chunk.pcm))
        keep(await _finish(encoder))
    except EngineFailed as exc:
        tracker.finish("failed")
        log.error("%s failed: %s", request_id, exc)
        cap.used -= mine
        hold.release()
        raise engine_error(exc) from None
    except BaseException:
        cap.used -= mine
        hold.release()
        raise
    finally:
        await chunks.aclose()
    tracker.sent_audio()
    tracker.finish("ok")
    return b"".join(pieces)


async def raw_stream(first, chunks: AsyncIterator, encoder: AudioEncoder, tracker: RequestTracker,
                      request_id: str) -> AsyncIterator[bytes]:
    outcome = "cancelled"
    try:
        async for chunk in _all_chunks(first, chunks):
            tracker.chunk(chunk)
            data = await _encode(encoder, chunk.pcm)
            if data:
                tracker.sent_audio()
                yield data
        tail = await _finish(encoder)
        if tail:
            tracker.sent_audio()
            yield tail
        outcome = "ok"
    except EngineFailed as exc:
        outcome = "failed"
        tracker.metrics.stream_cuts.labels(reason=exc.reason).inc()
        log.error("%s failed after %.2f s of audio; cutting the stream: %s", request_id,
                  tracker.audio_seconds, exc)
        raise StreamCut(str(exc)) from None
    finally:
        tracker.finish(outcome)
        await chunks.aclose()


async def _sse_stream(first, chunks: AsyncIterator, encoder: AudioEncoder, tracker: RequestTracker,
                      request_id: str, text: str, response_format: str, sample_rate: int,
                      channels: int, fields: FieldReport) -> AsyncIterator[bytes]:
    outcome = "cancelled"
    sent_any = False

    def delta(data: bytes) -> bytes:
        nonlocal sent_any
        first_delta = not sent_any
        sent_any = True
        tracker.sent_audio()
        return sse.delta(data, response_format, sample_rate=sample_rate if first_delta else None,
                         channels=channels if first_delta else None)

    try:
        async for chunk in _all_chunks(first, chunks):
            tracker.chunk(chunk)
            data = await _encode(encoder, chunk.pcm)
            if data:
                yield delta(data)
        tail = await _finish(encoder)
        if tail:
            yield delta(tail)
        yield sse.done(tracker.usage(text), finish_reason=tracker.finish_reason or "stop",
                       **fields.event_fields())
        outcome = "ok"
    except EngineFailed as exc:
        outcome = "failed"
        tracker.metrics.stream_cuts.labels(reason=exc.reason).inc()
        log.error("%s failed after %.2f s of audio: %s", request_id, tracker.audio_seconds, exc)
        yield sse.error(f"The engine failed this request: {exc}", partial_audio=sent_any,
                        code=503 if exc.unavailable or exc.reason == "deadline" else 500)
    finally:
        tracker.finish(outcome)
        await chunks.aclose()
