"""One WebSocket speech session: its config, its text buffer, its utterances, barge-in, limits.

The session logic every speech socket shares, whatever its wire protocol: `configure`, `text`,
`flush`, `cancel`, `finish` and `close`, with what it tells the client going through its
`SessionEvents` (`api.stream_events`). `handle(message)` maps one message of
`/v1/audio/speech/stream` (`api.stream_protocol`) onto them and says whether the session goes on;
the ElevenLabs-compatible sockets call them from their own messages (`api.elevenlabs_session`). Text goes to the session's speaking pipeline as it arrives: for models that speak whole
texts it is cut into sentences or clauses (per `split_granularity`), each spoken as soon as it
is complete (`api.stream_pipeline`); a model that takes text while it speaks (Realtime) gets it
as it comes, one request per utterance (`api.stream_incremental`). An utterance is what
`input.done` flushes: its index counts flushes, its sentences count from 0, and `session.done`
follows its last sentence's audio.

`input.cancel` (barge-in) and a closed socket stop the same way: the pipeline is closed (every
request in flight is aborted in both workers), buffered text is dropped, and for a cancel the
client gets `speech.audio.cancelled` and the session goes on with the next utterance.

A bad message (unknown type, invalid config, text over the session's limit, text before any
config) gets an `error` frame and changes nothing. The text limit (`stream.max_session_chars`) is
a `TextBudget`, shared by every session of one socket.
"""

from __future__ import annotations

import time

from api.errors import ApiError, bad_request, count_limit
from api.stream_events import SessionEvents
from api.stream_incremental import IncrementalPipeline
from api.stream_pipeline import SentencePipeline, close_quietly
from api.stream_protocol import ClientMessage, input_text
from api.stream_settings import SessionSettings, load_settings
from speech.segmenter import Segmenter


class TextBudget:
    """The text one socket may still send (`stream.max_session_chars`), shared by its sessions."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, chars: int) -> None:
        """Count `chars` more; an `ApiError` (nothing counted) past the limit."""
        if self.used + chars > self.limit:
            raise ApiError(400, f"this text would bring the session to {self.used + chars} "
                                f"characters; the limit is {self.limit} (stream.max_session_chars)",
                           param="text", code="session_text_limit", limit="stream.max_session_chars")
        self.used += chars


class SpeechSession:
    def __init__(self, state, events: SessionEvents, budget: TextBudget | None = None) -> None:
        self.state, self.events = state, events
        self.limits = state.profile.stream
        self.budget = budget or TextBudget(self.limits.max_session_chars)
        self.settings: SessionSettings | None = None
        self.pipeline: SentencePipeline | IncrementalPipeline | None = None
        self.utterance = 0        # index of the utterance now receiving text

    @property
    def busy(self) -> bool:
        """Speech is queued or being spoken."""
        return self.pipeline is not None and self.pipeline.busy

    @property
    def has_text(self) -> bool:
        """The utterance receiving text has some: text came after the last flush."""
        return self.pipeline is not None and self.pipeline.has_text

    async def handle(self, msg: ClientMessage) -> bool:
        """Act on one message of `/v1/audio/speech/stream`; False once the session should close.
        Bad messages get an error."""
        try:
            match msg.type:
                case "session.config":
                    await self.configure(await load_settings(msg.body, self.state))
                case "input.text":
                    self.text(input_text(msg.body))
                case "input.done":
                    self.flush()
                case "input.cancel":
                    await self.cancel()
                case "session.close":
                    await self.finish()
                    return False
        except ApiError as exc:
            count_limit(self.state, exc)
            await self.events.error(exc, msg.event_id)
        return True

    async def close(self) -> None:
        """The socket is gone (or the session ends): abort whatever is still speaking."""
        await close_quietly(self.pipeline)
        self.pipeline = None

    # ---- the session's actions -------------------------------------------------------------

    async def configure(self, settings: SessionSettings) -> None:
        """Use `settings` from now on (refused while text is buffered or being spoken)."""
        if self.busy or self.has_text:
            raise bad_request("session.config cannot change a session while text is buffered or "
                              "being spoken: send input.done (or input.cancel) and wait for "
                              "session.done first", code="session_busy")
        await close_quietly(self.pipeline)
        self.settings = settings
        self.pipeline = self._new_pipeline()

    def text(self, text: str, *, whole: bool = False) -> None:
        """More text of the utterance receiving text, spoken as its sentences complete; `whole`:
        the text ends a phrase (a segment ends with it whatever its last character)."""
        if self.settings is None:
            raise bad_request("send session.config before input.text", code="no_session_config")
        self.budget.take(len(text))
        self.pipeline.push(self.utterance, text, time.perf_counter())
        if whole:
            self.pipeline.cut(self.utterance)

    def flush(self, *, only_if_text: bool = False) -> None:
        """Speak what is buffered: the utterance ends, the next text starts another one."""
        if self.settings is None:
            raise bad_request("send session.config before input.done", code="no_session_config")
        if only_if_text and not self.pipeline.has_text:
            return
        self.pipeline.end(self.utterance)
        self.utterance += 1

    async def cancel(self) -> None:
        """Barge-in: stop speaking now, drop what is buffered; the session goes on."""
        if self.settings is None:
            raise bad_request("nothing to cancel: no session.config yet", code="no_session_config")
        speaking = self.pipeline.speaking_at
        dropped = len(self.pipeline.buffered)
        had_text = self.pipeline.has_text
        await close_quietly(self.pipeline)
        self.pipeline = self._new_pipeline()
        utterance, sentence = speaking if speaking is not None else (self.utterance, None)
        await self.events.cancelled(utterance, sentence, dropped)
        if had_text:  # the utterance receiving text is over; the next text starts a new one
            self.utterance += 1

    async def finish(self) -> None:
        """Speak what is buffered and wait until everything queued has been spoken."""
        if self.settings is not None:
            self.flush(only_if_text=True)
            await self.pipeline.idle.wait()

    def _new_pipeline(self) -> SentencePipeline | IncrementalPipeline:
        """Realtime takes text while it speaks; the other models speak whole sentences."""
        client = self.state.client
        if client.variant.takes_text_while_speaking:
            return IncrementalPipeline(client, self.events, self.settings, self.state.metrics)
        api = self.state.profile.api
        max_chars = min(self.limits.max_segment_chars, api.max_input_chars)
        segmenter = Segmenter(self.settings.split_granularity, max_chars=max_chars,
                              min_chars=min(self.limits.min_segment_chars, max_chars))
        return SentencePipeline(client, self.events, self.settings, self.state.metrics,
                                segmenter=segmenter, context_frames=self.limits.context_frames)
