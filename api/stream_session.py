"""One WebSocket speech session: its config, its text buffer, its utterances, barge-in, limits.

`handle(message)` acts on one client message (`api.stream_protocol`) and says whether the session
goes on. Text goes to the session's speaking pipeline as it arrives: for models that speak whole
texts it is cut into sentences or clauses (per `split_granularity`), each spoken as soon as it
is complete (`api.stream_pipeline`); a model that takes text while it speaks (Realtime) gets it
as it comes, one request per utterance (`api.stream_incremental`). An utterance is what
`input.done` flushes: its index counts flushes, its sentences count from 0, and `session.done`
follows its last sentence's audio.

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
from api.stream_incremental import IncrementalPipeline
from api.stream_pipeline import SentencePipeline, close_quietly
from api.stream_protocol import ClientMessage, cancelled, error_event, input_text
from api.stream_settings import SessionSettings, load_settings
from speech.segmenter import Segmenter


class SpeechSession:
    def __init__(self, state, out: Outbound) -> None:
        self.state, self.out = state, out
        self.limits = state.profile.stream
        self.settings: SessionSettings | None = None
        self.pipeline: SentencePipeline | IncrementalPipeline | None = None
        self.utterance = 0        # index of the utterance now receiving text
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
        if self.busy or (self.pipeline is not None and self.pipeline.has_text):
            raise bad_request("session.config cannot change a session while text is buffered or "
                              "being spoken: send input.done (or input.cancel) and wait for "
                              "session.done first", code="session_busy")
        settings = await load_settings(body, self.state)
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
        self.pipeline.push(self.utterance, text, time.perf_counter())

    def _flush(self, *, only_if_text: bool = False) -> None:
        if self.settings is None:
            raise bad_request("send session.config before input.done", code="no_session_config")
        if only_if_text and not self.pipeline.has_text:
            return
        self.pipeline.end(self.utterance)
        self.utterance += 1

    async def _cancel(self) -> None:
        if self.settings is None:
            raise bad_request("nothing to cancel: no session.config yet", code="no_session_config")
        speaking = self.pipeline.speaking_at
        dropped = len(self.pipeline.buffered)
        had_text = self.pipeline.has_text
        await close_quietly(self.pipeline)
        self.pipeline = self._new_pipeline()
        utterance, sentence = speaking if speaking is not None else (self.utterance, None)
        await self.out.send_json(cancelled(utterance, sentence, dropped))
        if had_text:  # the utterance receiving text is over; the next text starts a new one
            self.utterance += 1

    def _new_pipeline(self) -> SentencePipeline | IncrementalPipeline:
        """Realtime takes text while it speaks; the other models speak whole sentences."""
        client = self.state.client
        if client.variant.takes_text_while_speaking:
            return IncrementalPipeline(client, self.out, self.settings, self.state.metrics)
        api = self.state.profile.api
        max_chars = min(self.limits.max_segment_chars, api.max_input_chars)
        segmenter = Segmenter(self.settings.split_granularity, max_chars=max_chars,
                              min_chars=min(self.limits.min_segment_chars, max_chars))
        return SentencePipeline(client, self.out, self.settings, self.state.metrics,
                                segmenter=segmenter, context_frames=self.limits.context_frames)
