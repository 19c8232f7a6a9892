"""Speaking a session's sentences in order: one engine request per sentence, no overlap, no gap.

`push` cuts text into sentences or clauses as it arrives (`speech.segmenter`) and queues each
complete one; `cut` queues what is buffered as one more (a client that sends whole phrases says
where they end); `end` queues the rest and closes the utterance (its `session.done` follows its last
sentence). Two tasks run per pipeline: the *starter* begins each sentence's generation as soon
as there is room (the sentence being spoken plus one ahead), so the next sentence is generated
while the previous one streams; the *speaker* sends each sentence's audio in order
(`audio.start`, binary frames, `audio.done`), buffering the one ahead until its turn.

Where the model continues audio (`Variant.continues_context`, Local-v1.5), a sentence after the
first of its utterance waits until the previous one's codes are complete and continues them (its
text and codes as the continuation prompt, when it has at most `context_frames` frames); the
voice reference is the same for every sentence.

`close()` stops everything at once: every request in flight is aborted (closing its chunk
iterator reaches both workers), queued sentences are dropped, nothing more is sent. Barge-in
closes the pipeline and starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from api.errors import ApiError
from api.stream_events import SessionEvents
from api.stream_output import PeerGone
from api.stream_settings import SessionSettings
from engine.client import EngineFailed, EngineRejected
from speech.segmenter import Segmenter

log = logging.getLogger("mossvox.api")

LOOKAHEAD = 1  # sentences generated ahead of the one being spoken


@dataclass(eq=False)
class Sentence:
    utterance: int
    index: int
    text: str
    ready_at: float  # perf_counter when its text was complete
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)  # AudioChunk | Exception | None
    codes: list[np.ndarray] = field(default_factory=list)  # [T, n_vq] each, when echoed
    generated: asyncio.Event = field(default_factory=asyncio.Event)
    failed: bool = False
    task: asyncio.Task | None = None


@dataclass(frozen=True)
class UtteranceEnd:
    utterance: int
    sentences: int


class SentencePipeline:
    def __init__(self, client, events: SessionEvents, settings: SessionSettings, metrics, *,
                 segmenter: Segmenter, context_frames: int) -> None:
        self.client, self.events, self.settings, self.metrics = client, events, settings, metrics
        self.segmenter = segmenter
        self._count = 0  # sentences of the utterance receiving text, so far
        self.continues = client.variant.continues_context and context_frames > 0
        self.context_frames = context_frames
        self._todo: asyncio.Queue = asyncio.Queue()   # Sentence | UtteranceEnd, in order
        self._ready: asyncio.Queue = asyncio.Queue()  # the same, once started
        self._room = asyncio.Semaphore(1 + LOOKAHEAD)
        self._live: set[Sentence] = set()
        self._pending = 0  # items added and not yet spoken
        self.speaking: Sentence | None = None
        self._first_audio_done: set[int] = set()  # utterances whose first audio went out
        self._tasks = [asyncio.get_running_loop().create_task(self._start_loop()),
                       asyncio.get_running_loop().create_task(self._speak_loop())]
        self.idle = asyncio.Event()
        self.idle.set()

    @property
    def busy(self) -> bool:
        """Speech is queued or being spoken."""
        return self._pending > 0

    @property
    def buffered(self) -> str:
        """Text received and not yet part of a sentence."""
        return self.segmenter.buffered

    @property
    def has_text(self) -> bool:
        """The utterance receiving text has some (spoken, queued or buffered)."""
        return self._count > 0 or bool(self.buffered.strip())

    @property
    def speaking_at(self) -> tuple[int, int] | None:
        """(utterance, sentence) being spoken now."""
        return None if self.speaking is None else (self.speaking.utterance, self.speaking.index)

    def push(self, utterance: int, text: str, now: float) -> None:
        for piece in self.segmenter.push(text):
            self._add(utterance, piece, now)

    def cut(self, utterance: int) -> None:
        """What is buffered is a complete segment: spoken as one, the utterance going on."""
        rest = self.segmenter.flush()
        if rest is not None:
            self._add(utterance, rest, time.perf_counter())

    def end(self, utterance: int) -> None:
        rest = self.segmenter.flush()
        if rest is not None:
            self._add(utterance, rest, time.perf_counter())
        self._put(UtteranceEnd(utterance, self._count))
        self._count = 0

    def _add(self, utterance: int, text: str, now: float) -> None:
        self._put(Sentence(utterance, self._count, text, now))
        self._count += 1

    def _put(self, item) -> None:
        self._pending += 1
        self.idle.clear()
        self._todo.put_nowait(item)

    async def close(self) -> None:
        """Stop now: abort every request in flight, drop the rest."""
        tasks = [*self._tasks, *(s.task for s in self._live if s.task is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._live.clear()
        self._pending = 0
        self.idle.set()

    # ---- starting generation ---------------------------------------------------------------

    async def _start_loop(self) -> None:
        previous: Sentence | None = None
        while True:
            item = await self._todo.get()
            if isinstance(item, UtteranceEnd):
                previous = None
                self._ready.put_nowait(item)
                continue
            await self._room.acquire()
            context = None
            if self.continues and previous is not None:
                await previous.generated.wait()
                context = self._context(previous)
            item.task = asyncio.get_running_loop().create_task(self._generate(item, context))
            self._live.add(item)
            self._ready.put_nowait(item)
            previous = item

    def _context(self, previous: Sentence) -> tuple[np.ndarray, str] | None:
        if previous.failed or not previous.codes:
            return None
        codes = np.concatenate(previous.codes)
        return (codes, previous.text) if len(codes) <= self.context_frames else None

    async def _generate(self, sentence: Sentence, context) -> None:
        codes, text = context if context is not None else (None, None)
        job = self.settings.job(sentence.text, context_codes=codes, context_text=text)
        chunks = self.client.generate(job, echo_codes=self.continues)
        try:
            async for chunk in chunks:
                if chunk.codes is not None:
                    sentence.codes.append(chunk.codes)
                sentence.chunks.put_nowait(chunk)
        except (EngineRejected, EngineFailed, ValueError) as exc:
            sentence.failed = True
            sentence.chunks.put_nowait(exc)
        finally:
            await chunks.aclose()
            sentence.chunks.put_nowait(None)
            sentence.generated.set()

    # ---- speaking in order -----------------------------------------------------------------

    async def _speak_loop(self) -> None:
        while True:
            item = await self._ready.get()
            try:
                if isinstance(item, UtteranceEnd):
                    await self.events.utterance_done(item.utterance, item.sentences)
                    self.metrics.stream_utterances.inc()
                else:
                    self.speaking = item
                    try:
                        await self._speak(item)
                    finally:
                        self.speaking = None
                        if item.task is not None:  # stopped early (peer gone): abort its request
                            item.task.cancel()
                        self._live.discard(item)
                        self._room.release()
            except PeerGone:  # nothing more can be spoken; the session closes this pipeline
                self.idle.set()
                return
            except Exception:  # a bug must not leave the session waiting forever
                log.exception("speech session: speaking failed")
            finally:
                self._pending -= 1
                if self._pending == 0:
                    self.idle.set()

    async def _speak(self, s: Sentence) -> None:
        async def items():
            while (item := await s.chunks.get()) is not None:
                yield item

        first_audio = None if s.utterance in self._first_audio_done else s.ready_at
        self._first_audio_done.add(s.utterance)
        await speak(self.events, self.settings, self.metrics, items(), utterance=s.utterance,
                    index=s.index, text=lambda: s.text, first_audio_from=first_audio)


async def speak(events: SessionEvents, settings: SessionSettings, metrics, items, *, utterance: int,
                index: int, text, first_audio_from: float | None) -> None:
    """One sentence's start, audio and end events: `items` yields its `AudioChunk`s (or the
    engine error that ended it); `text()` is its text when audio starts; with `first_audio_from`
    the time from then to its first audio is recorded."""
    await events.sentence_start(utterance, index, text(), settings.response_format,
                                settings.out_rate, settings.out_channels)
    encoder = settings.encoder()
    total, samples, held, reason, error = 0, 0, [], None, False

    async def emit(data: bytes) -> None:
        nonlocal total, first_audio_from
        if not data:
            return
        total += len(data)
        if first_audio_from is not None:
            metrics.stream_ttfa.observe(time.perf_counter() - first_audio_from)
            first_audio_from = None
        if settings.stream_audio:
            await events.audio(data)
        else:
            held.append(data)

    async for item in items:
        if isinstance(item, Exception):
            error = True
            if isinstance(item, EngineFailed):
                metrics.stream_cuts.labels(reason=item.reason).inc()
            await events.error(as_api_error(item, f"sentence {index} of utterance {utterance}"))
            continue
        samples += item.pcm.shape[0]
        if item.final:
            reason = item.finish_reason
        await emit(await run_encoder(encoder, encoder.encode, item.pcm))
    if not error:
        await emit(await run_encoder(encoder, encoder.finish))
    if held:
        await events.audio(b"".join(held))
    seconds = samples / settings.sample_rate
    if samples:
        metrics.audio_seconds.inc(seconds)
    await events.sentence_done(utterance, index, total, seconds, reason, error,
                               settings.done_fields(text()))


async def run_encoder(encoder, call, *args) -> bytes:
    """Real codecs (mp3 ~30 ms per second of stereo audio) run in a thread; PCM/WAV inline."""
    return await asyncio.to_thread(call, *args) if encoder.heavy else call(*args)


def as_api_error(exc: Exception, where: str) -> ApiError:
    """An engine error while speaking (`where`: which sentence or utterance) for an error frame."""
    if isinstance(exc, EngineRejected):
        return ApiError(429, f"{where} was rejected by admission: {exc.reason}", code="overloaded")
    if isinstance(exc, ValueError):
        return ApiError(400, f"{where}: {exc}")
    if isinstance(exc, EngineFailed) and (exc.unavailable or exc.reason == "deadline"):
        return ApiError(503, f"the engine could not serve {where} now: {exc}", code="engine_unavailable")
    return ApiError(500, f"the engine failed {where}: {exc}")


async def close_quietly(pipeline) -> None:
    if pipeline is not None:
        with contextlib.suppress(Exception):
            await pipeline.close()
