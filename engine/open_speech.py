"""`OpenSpeech`: one request whose text arrives while it speaks (`EngineClient.open_speech`).

Text goes to the variant's `TextStream` as it comes (`push`). Once the stream has text enough for
the request's prompt it is submitted with `open_input`; every later piece of input goes to the
talker in a `Feed` record as soon as the stream releases it; `end()` sends the final `Feed` (with
the whole text's forced length). `chunks()` yields the audio as it is made: the request runs,
pauses when its text runs out and goes on when more comes, in the talker. Closing `chunks()`
(or `abandon()`, when nobody reads it) before the final chunk aborts it in both workers, like
`generate`. Opened `held`, it is not submitted (its text waits in the stream) until `release()`:
a caller that queues several keeps only the ones it will speak soon in the engine.

Lives in the API process (or the offline caller), next to its `EngineClient`; no model logic:
the variant's text stream decides what the prompt and the rows are.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from ipc.messages import Feed
from speech.job import SpeechJob
from stages.variant import TextStream


class OpenSpeech:
    def __init__(self, client: Any, stream: TextStream, job: SpeechJob, *, held: bool = False) -> None:
        self._client, self.stream, self._job = client, stream, job
        self.rid: int | None = None
        self._box = None
        self.held = held
        self._ended = False
        self._started = asyncio.Event()  # submitted, ended without any text, or failed to submit
        self._reading = False  # chunks() took the request: closing it aborts
        self._abandoned = False
        self._failure: Exception | None = None  # why a release could not submit it

    @property
    def submitted(self) -> bool:
        return self.rid is not None

    def push(self, text: str) -> None:
        """More text (any size, any split). Raises `EngineFailed` when the engine is gone."""
        if self._ended:
            raise RuntimeError("push after end")
        self.stream.push(text)
        self._pump()

    def end(self) -> None:
        """No more text: the request speaks what it has and finishes."""
        if not self._ended:
            self._ended = True
            self.stream.end()
            self._pump()
            if not self.held:
                self._started.set()

    def release(self) -> None:
        """Submit it (once its stream has a prompt) now that it may run; no-op unless held. An
        engine that cannot take it (`EngineFailed`) is raised by `chunks()`."""
        if self.held:
            self.held = False
            try:
                self._pump()
            except Exception as exc:  # nobody to tell now: the reader of chunks() hears it
                self._failure = exc
                self._started.set()
            if self._ended:
                self._started.set()

    async def chunks(self) -> AsyncIterator:
        """The audio (`AudioChunk`s) from the first frame on; none when no text ever came.
        Closed before its final chunk (even before the first), the request is aborted."""
        try:
            await self._started.wait()
        except BaseException:  # closed or cancelled while waiting to start
            self.abandon()
            raise
        if self._failure is not None:
            raise self._failure
        if self.rid is None or self._abandoned:
            return
        self._reading = True
        async with contextlib.aclosing(self._client._receive(self.rid, self._box)) as chunks:
            async for chunk in chunks:
                yield chunk

    def abandon(self) -> None:
        """Give the request up when `chunks()` never took it (closing `chunks()` aborts by itself)."""
        if self.rid is not None and not self._reading and not self._abandoned:
            self._abandoned = True
            self._client._forget(self.rid)

    def _pump(self) -> None:
        if self.held:
            return
        if self.rid is None:
            request = self.stream.request()
            if request is None:
                return
            self.rid, self._box = self._client._submit(request, self._job, open_input=True)
            self._started.set()
        rows = self.stream.take_rows()
        if len(rows) or self._ended:
            forced = self.stream.forced_frames() if self._ended else None
            self._client._send(Feed(rid=self.rid, final=self._ended, forced_frames=forced), rows)
