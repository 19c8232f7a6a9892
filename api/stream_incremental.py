"""Speaking a session's utterances with a model that takes text while it speaks (Realtime).

No sentence waits: each utterance is one request (`EngineClient.open_speech`), submitted once its
first words are there (the model's prefill, 12 tokens) and fed every later piece of text as it
arrives; `input.done` ends its text and it finishes speaking. The utterance is reported as one
sentence: `audio.start` (with the text received by then) before its first audio, `audio.done`
and `session.done` after it. Utterances are spoken in order; the one after the utterance being
spoken may already be generating (its text arrived) while that one streams, its audio held until
its turn. Later ones keep their text in the API process and are submitted as their turn nears,
so a session holds at most two requests in the engine however many utterances it queues.

The same interface as `SentencePipeline` for the session: `push`, `cut`, `end`, `close`, `busy`,
`idle`, `buffered`, `has_text`, `speaking_at`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from api.errors import ApiError
from api.stream_events import SessionEvents
from api.stream_output import PeerGone
from api.stream_pipeline import LOOKAHEAD, speak
from api.stream_settings import SessionSettings
from engine.client import EngineFailed, EngineRejected
from engine.open_speech import OpenSpeech

log = logging.getLogger("mossvox.api")


@dataclass(eq=False)
class _Utterance:
    index: int
    speech: OpenSpeech
    started_at: float | None = None  # when its text got the request submitted


class IncrementalPipeline:
    def __init__(self, client, events: SessionEvents, settings: SessionSettings, metrics) -> None:
        self.client, self.events, self.settings, self.metrics = client, events, settings, metrics
        self._current: _Utterance | None = None  # receiving text
        self._all: list[_Utterance] = []         # queued or speaking, in order
        self._queue: asyncio.Queue = asyncio.Queue()
        self._speaking: _Utterance | None = None
        self._closing = False
        self.idle = asyncio.Event()
        self.idle.set()
        self._task = asyncio.get_running_loop().create_task(self._speak_loop())

    @property
    def busy(self) -> bool:
        """An utterance whose text has ended is still to be spoken (the one receiving text waits
        for the client, which the idle timeout bounds)."""
        return any(u is not self._current for u in self._all)

    @property
    def buffered(self) -> str:
        """Text of the utterance receiving text that nothing has spoken yet."""
        u = self._current
        return "" if u is None or u is self._speaking else u.speech.stream.text

    @property
    def has_text(self) -> bool:
        return self._current is not None and bool(self._current.speech.stream.text.strip())

    @property
    def speaking_at(self) -> tuple[int, int] | None:
        return None if self._speaking is None else (self._speaking.index, 0)

    def push(self, utterance: int, text: str, now: float) -> None:
        u = self._open(utterance)
        _engine_call(u.speech.push, text)
        if u.started_at is None and u.speech.submitted:
            u.started_at = now

    def cut(self, utterance: int) -> None:
        """Nothing to do: the text is fed as it comes, whatever its phrases."""

    def end(self, utterance: int) -> None:
        u = self._open(utterance)
        _engine_call(u.speech.end)
        if u.started_at is None and u.speech.submitted:
            u.started_at = time.perf_counter()
        self._current = None

    async def close(self) -> None:
        """Stop now: every request in flight is aborted, nothing more is sent."""
        self._closing = True  # nothing held is submitted any more
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        for u in self._all:
            u.speech.abandon()  # those chunks() never read; the one read was closed by the cancel
        self._all.clear()
        self._current = None
        self.idle.set()

    def _open(self, utterance: int) -> _Utterance:
        if self._current is None:
            in_engine = sum(not u.speech.held for u in self._all)
            speech = _engine_call(self.client.open_speech, self.settings.job(""),
                                  held=in_engine >= 1 + LOOKAHEAD)
            self._current = _Utterance(utterance, speech)
            self._all.append(self._current)
            self.idle.clear()
            self._queue.put_nowait(self._current)
        return self._current

    async def _speak_loop(self) -> None:
        while True:
            u = await self._queue.get()
            self._speaking = u
            try:
                spoken = await self._speak(u)
                await self.events.utterance_done(u.index, 1 if spoken else 0)
                self.metrics.stream_utterances.inc()
            except PeerGone:  # nothing more can be spoken; the session closes this pipeline
                self.idle.set()
                return
            except Exception:  # a bug must not leave the session waiting forever
                log.exception("speech session: utterance %d failed", u.index)
            finally:
                self._speaking = None
                self._all.remove(u)
                self._release_next()
                if not self._all:
                    self.idle.set()

    def _release_next(self) -> None:
        """Submit the next held utterance, now that one left the engine."""
        u = next((u for u in self._all if u.speech.held), None)
        if u is None or self._closing:
            return
        u.speech.release()  # an engine that cannot take it: its chunks() raises why
        if u.started_at is None and u.speech.submitted:
            u.started_at = time.perf_counter()

    async def _speak(self, u: _Utterance) -> bool:
        """The utterance's audio as one sentence; False when it had no text at all. However it
        ends (the peer gone, too), its request is closed: aborted in both workers if unfinished."""
        async with contextlib.aclosing(u.speech.chunks()) as chunks:
            return await self._speak_chunks(u, chunks)

    async def _speak_chunks(self, u: _Utterance, chunks) -> bool:
        first = await _first(chunks)
        if first is None:
            return False

        async def items():
            yield first
            try:
                async for chunk in chunks:
                    yield chunk
            except (EngineRejected, EngineFailed, ValueError) as exc:
                yield exc

        await speak(self.events, self.settings, self.metrics, items(), utterance=u.index, index=0,
                    text=lambda: u.speech.stream.text.strip(), first_audio_from=u.started_at)
        return True


async def _first(chunks):
    """The first item of `chunks`: a chunk, the engine error it ended with, or None (no text)."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None
    except (EngineRejected, EngineFailed, ValueError) as exc:
        return exc


def _engine_call(call, *args, **kwargs):
    """`call(*args, **kwargs)` with the engine's refusals as client-visible errors."""
    try:
        return call(*args, **kwargs)
    except EngineFailed as exc:
        raise ApiError(503, f"the engine cannot take text now: {exc}", code="engine_failed") from None
    except ValueError as exc:  # the variant refuses the session's fields
        raise ApiError(400, str(exc)) from None
