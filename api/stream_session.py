"""One WebSocket speech session: its config, its text buffer, its utterances, barge-in, limits.

`handle(message)` acts on one client message (`api.stream_protocol`) and says whether the session
goes on. Text is cut into sentences or clauses as it arrives (`speech.segmenter`, per the
session's `split_granularity`); each complete one goes to the speaking pipeline at once
(`api.stream_pipeline`). An utterance is what `input.done` flushes: its index counts flushes, its
sentences count from 0, and `session.done` follows its last sentence's audio.

`input.cancel` (barge-in) and a closed socket stop the same way: the pipeline is closed (every
request in flight is aborted in both workers), buffered text is dropped, and for a cancel the
client gets `speech.audio.cancelled` and the session goes on with the next utterance.

A bad message (unknown type, invalid config, text over the session's limit, text before any
config) gets an `error` frame and changes nothing.
"""

from __future__ import annotations

import time

from api.errors import ApiError, bad_request
from api.stream_output import Outbound
from api.stream_pipeline import Sentence, SentencePipeline, close_quietly
from api.stream_protocol import ClientMessage, cancelled, error_event, input_text
from api.stream_settings import SessionSettings, load_settings
from speech.segmenter import Segmenter


class SpeechSession:
    def __init__(self, state, out: Outbound) -> None:
        self.state, self.out = state, out
        self.limits = state.profile.stream
        self.settings: SessionSettings | None = None
        self.segmenter: Segmenter | None = None
        self.pipeline: SentencePipeline | None = None
        self.utterance = 0        # index of the utterance now receiving text
        self.sentences = 0        # sentences of that utterance handed to the pipeline so far
        self.chars = 0            # text received by this session in all

    @property
    def busy(self) -> bool:
        """Speech is queued or being spoken."""
        return self.pipeline is not None and self.pipeline.busy

    async def handle(self, msg: ClientMessage) -> bool:
        """Act on one message; False once the session should close. Bad messages get an error."""
        try:
            match msg.type:
                case "session.config":
                    await self._configure(msg.body)
                case "input.text":
                    self._text(input_text(msg.body))
                case "input.done":
                    self._flush()
                case "input.cancel":
                    await self._cancel()
                case "session.close":
                    if self.settings is not None:
                        self._flush(only_if_text=True)
                        await self.pipeline.idle.wait()
                    return False
        except ApiError as exc:
            await self.out.send_json(error_event(exc, msg.event_id))
        return True

    async def close(self) -> None:
        """The socket is gone (or the session ends): abort whatever is still speaking."""
        await close_quietly(self.pipeline)
        self.pipeline = None

    # ---- messages --------------------------------------------------------------------------

    async def _configure(self, body: dict) -> None:
        if self.busy or (self.segmenter is not None and self.segmenter.buffered.strip()):
            raise bad_request("session.config cannot change a session while text is buffered or "
                              "being spoken: send input.done (or input.cancel) and wait for "
                              "session.done first", code="session_busy")
        settings = await load_settings(body, self.state)
        max_chars = min(self.limits.max_segment_chars, self.state.profile.api.max_input_chars)
        self.segmenter = Segmenter(settings.split_granularity,
                                   min_chars=min(self.limits.min_segment_chars, max_chars),
                                   max_chars=max_chars)
        await close_quietly(self.pipeline)
        self.settings = settings
        self.pipeline = self._new_pipeline()

    def _text(self, text: str) -> None:
        if self.settings is None:
            raise bad_request("send session.config before input.text", code="no_session_config")
        if self.chars + len(text) > self.limits.max_session_chars:
            raise ApiError(400, f"this text would bring the session to {self.chars + len(text)} "
                                f"characters; the limit is {self.limits.max_session_chars} "
                                f"(stream.max_session_chars)", param="text",
                           code="session_text_limit")
        self.chars += len(text)
        now = time.perf_counter()
        for piece in self.segmenter.push(text):
            self._speak(piece, now)

    def _flush(self, *, only_if_text: bool = False) -> None:
        if self.settings is None:
            raise bad_request("send session.config before input.done", code="no_session_config")
        rest = self.segmenter.flush()
        if only_if_text and rest is None and self.sentences == 0:
            return
        if rest is not None:
            self._speak(rest, time.perf_counter())
        self.pipeline.end(self.utterance, self.sentences)
        self.utterance += 1
        self.sentences = 0

    def _speak(self, text: str, ready_at: float) -> None:
        self.pipeline.add(Sentence(self.utterance, self.sentences, text, ready_at))
        self.sentences += 1

    async def _cancel(self) -> None:
        if self.settings is None:
            raise bad_request("nothing to cancel: no session.config yet", code="no_session_config")
        speaking = self.pipeline.speaking
        dropped = len(self.segmenter.buffered)
        had_text = self.sentences > 0 or bool(self.segmenter.buffered.strip())
        self.segmenter.clear()
        await close_quietly(self.pipeline)
        self.pipeline = self._new_pipeline()
        utterance = speaking.utterance if speaking is not None else self.utterance
        await self.out.send_json(cancelled(utterance, speaking.index if speaking else None, dropped))
        if had_text:  # the utterance receiving text is over; the next text starts a new one
            self.utterance += 1
            self.sentences = 0

    def _new_pipeline(self) -> SentencePipeline:
        return SentencePipeline(self.state.client, self.out, self.settings, self.state.metrics,
                                context_frames=self.limits.context_frames)
