"""The ElevenLabs-compatible sockets' sessions: their messages (`api.elevenlabs_protocol`) acted on
by the session logic every speech socket shares (`api.stream_session`).

Each stream of text, the single socket's or one context of the multi-context socket, is a
`SpeechSession` of its own: text is cut into sentences and each is spoken as soon as it is
complete, the next one generated while the previous one plays; ``flush`` ends an utterance
(what is buffered is spoken now). A stream ends in one of two ways:
- it is spoken to the end: ``{"text": ""}`` on the single socket, ``close_context`` on a context
  whose text has all been flushed, ``close_socket`` for every context: what is queued is spoken,
  then ``isFinal``;
- it stops now (barge-in): ``close_context`` on a context with text sent since its last flush
  (that text is not to be spoken), or a second ``close_context`` on a context still finishing:
  every request in flight is aborted in both workers, then ``isFinal``.
A closed socket stops every stream the same way. The socket's settings come from the handshake
(`SocketQuery`) and the voice in its path; a context's first message may add its own
``voice_settings`` (speed). The text limit (`stream.max_session_chars`) is the socket's, across its
contexts; `stream.max_contexts` bounds the contexts open at once. When the handshake carried no
key on a server with keys (`api.auth`), the first message must.
"""

from __future__ import annotations

import asyncio
import dataclasses

from starlette.websockets import WebSocket

from api.auth import DEFERRED_KEY_CHECK
from api.elevenlabs_protocol import (ClientFrame, ElevenLabsEvents, SocketQuery, decode_frame,
                                     error_message, socket_query)
from api.elevenlabs_request import (elevenlabs_names, in_elevenlabs_terms, refuse_unused,
                                    speech_request)
from api.errors import ApiError, count_limit
from api.stream_output import Outbound, PeerGone
from api.stream_protocol import SessionFields
from api.stream_session import SpeechSession, TextBudget
from api.stream_settings import SessionSettings, settings_for
from api.stream_socket import CLOSE_POLICY, SocketSession


class TextStream:
    """One stream of text and its audio: a `SpeechSession` and the `isFinal` that ends it."""

    def __init__(self, state, out: Outbound, context_id: str | None, budget: TextBudget, *,
                 whole_messages: bool) -> None:
        self.context_id = context_id
        self.whole_messages = whole_messages  # auto_mode: each message is a complete phrase
        self.events = ElevenLabsEvents(out, context_id)
        self.session = SpeechSession(state, self.events, budget)
        self.ending: asyncio.Task | None = None  # set once the stream was asked to end
        self.final_sent = False

    def take(self, frame: ClientFrame) -> None:
        """A message's text and flush."""
        if frame.text:
            self.session.text(frame.text, whole=self.whole_messages)
        if frame.flush:
            self.session.flush(only_if_text=True)

    async def end(self, *, speak_rest: bool) -> None:
        """Speak what is queued (`speak_rest`) or stop now; then `isFinal` (once)."""
        if speak_rest:
            await self.session.finish()
        await self.session.close()
        if not self.final_sent:
            self.final_sent = True
            settings = self.session.settings
            await self.events.final(settings.report.event_fields() if settings is not None else {})


class ElevenLabsSocket(SocketSession):
    """One ElevenLabs-compatible socket: ``stream-input`` (`multi` False: one stream) or
    ``multi-stream-input`` (contexts)."""

    idle_source = "inactivity_timeout"
    idle_close = CLOSE_POLICY

    def __init__(self, state, out: Outbound, websocket: WebSocket, *, multi: bool) -> None:
        self.state, self.out, self.websocket, self.multi = state, out, websocket, multi
        self.idle_s = float(state.profile.stream.idle_timeout_s)
        self.key_check = websocket.scope.get(DEFERRED_KEY_CHECK)  # the first message's key, if set
        self.budget = TextBudget(state.profile.stream.max_session_chars)
        self.streams: dict[str | None, TextStream] = {}
        self.settings: SessionSettings | None = None
        self.query: SocketQuery | None = None

    @property
    def busy(self) -> bool:
        return any(s.session.busy or (s.ending is not None and not s.ending.done())
                   for s in self.streams.values())

    def error_message(self, exc: ApiError) -> dict:
        if exc.code == "idle_timeout":  # ElevenLabs' name for it
            exc.code = "input_timeout_exceeded"
        return error_message(in_elevenlabs_terms(exc))

    async def open(self) -> None:
        """The handshake's query and voice: the settings every stream starts from (once the
        first message has brought the key, when the handshake had none: nothing is looked up
        for a client without one)."""
        if self.key_check is None:
            await self._settings()

    async def _settings(self) -> None:
        state = self.state
        self.query = query = socket_query(self.websocket.query_params)
        self.idle_s = query.inactivity_s
        req, foreign = speech_request("-", self.websocket.path_params["voice_id"], fmt=query.fmt,
                                      model_id=query.model_id, language_code=query.language_code,
                                      speed=1.0, seed=query.seed, model_names=state.model_names)
        unused = foreign + query.unused
        refuse_unused(unused, strict=state.profile.api.strict_fields)
        settings = await settings_for(SessionFields(req), state, plan=query.fmt.plan(mode="audio", speed=1.0),
                                      ignored=unused)
        report = dataclasses.replace(settings.report, ignored=elevenlabs_names(settings.report.ignored))
        self.settings = dataclasses.replace(settings, report=report)

    async def receive(self, text: str) -> bool:
        try:
            frame = decode_frame(text)
        except ApiError as exc:
            await self.out.send_json(error_message(exc))
            return True
        if self.key_check is not None:
            if not await self._authorized(frame):
                return False
            try:
                await self._settings()
            except ApiError as exc:
                await self.out.send_json(self.error_message(exc))
                await self.out.close(CLOSE_POLICY, exc.code or "")
                return False
        context_id = frame.context_id if self.multi else None
        try:
            return await (self._multi(frame) if self.multi else self._single(frame))
        except ApiError as exc:
            count_limit(self.state, exc)
            await self.out.send_json(error_message(in_elevenlabs_terms(exc), context_id))
            return True

    async def close(self) -> None:
        for stream in self.streams.values():
            if stream.ending is not None:
                stream.ending.cancel()
            await stream.session.close()
        self.streams.clear()

    # ---- the two sockets -------------------------------------------------------------------

    async def _single(self, frame: ClientFrame) -> bool:
        stream = self.streams.get(None) or await self._open_stream(None, frame)
        if frame.text == "" and not frame.flush:  # the end of the text: speak the rest, then close
            await stream.end(speak_rest=True)
            return False
        stream.take(frame)
        return True

    async def _multi(self, frame: ClientFrame) -> bool:
        if frame.close_socket:  # every context spoken to its end, then the socket closes
            for stream in list(self.streams.values()):
                if stream.ending is None:
                    self._end(stream, speak_rest=True)
            await asyncio.gather(*(s.ending for s in list(self.streams.values())), return_exceptions=True)
            return False
        stream = self.streams.get(frame.context_id)
        if frame.close_context:
            if stream is not None:  # one not open (or already gone): nothing to close
                speak_rest = stream.ending is None and not stream.session.has_text
                self._end(stream, speak_rest=speak_rest)
            return True
        if not frame.text and not frame.flush:  # a keep-alive (of a context open, ending or gone)
            return True
        if stream is not None and stream.ending is not None:
            raise ApiError(409, f"context {frame.context_id!r} is closing: open a new one (or send "
                                f"text to it once its isFinal has arrived)", code="context_closing")
        if stream is None:
            if len(self.streams) >= self.state.profile.stream.max_contexts:
                raise ApiError(400, f"this socket has {len(self.streams)} contexts open already "
                                    f"(stream.max_contexts): close one first", code="too_many_contexts",
                               limit="stream.max_contexts")
            stream = await self._open_stream(frame.context_id, frame)
        stream.take(frame)
        return True

    # ---- streams ---------------------------------------------------------------------------

    async def _authorized(self, frame: ClientFrame) -> bool:
        """The first message's key, when the handshake had none; a missing or wrong one closes
        the socket (1008)."""
        if frame.key is None or not self.key_check(frame.key.encode()):
            problem = "Missing API key" if frame.key is None else "Incorrect API key provided"
            await self.out.send_json(error_message(ApiError(401, f"{problem}: send it as xi-api-key "
                                                                 f"in the first message or the handshake",
                                                            code="invalid_api_key")))
            await self.out.close(CLOSE_POLICY, "invalid_api_key")
            return False
        self.key_check = None
        return True

    async def _open_stream(self, context_id: str | None, frame: ClientFrame) -> TextStream:
        """A stream with the socket's settings and the first message's own."""
        refuse_unused(frame.unused, strict=self.state.profile.api.strict_fields)
        settings = self.settings
        if frame.speed is not None:
            settings = dataclasses.replace(settings, output=dataclasses.replace(settings.output, speed=frame.speed))
        if frame.unused:
            report = dataclasses.replace(settings.report, ignored=(*settings.report.ignored, *frame.unused))
            settings = dataclasses.replace(settings, report=report)
        stream = TextStream(self.state, self.out, context_id, self.budget,
                            whole_messages=self.query.auto_mode)
        try:
            settings.encoder()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="voice_settings.speed") from None
        await stream.session.configure(settings)
        self.streams[context_id] = stream
        return stream

    def _end(self, stream: TextStream, *, speak_rest: bool) -> None:
        """End `stream` in the background (the socket goes on receiving); a stream already
        ending is stopped now."""
        if stream.ending is not None:
            stream.ending.cancel()
        stream.ending = asyncio.get_running_loop().create_task(self._ended(stream, speak_rest))

    async def _ended(self, stream: TextStream, speak_rest: bool) -> None:
        try:
            await stream.end(speak_rest=speak_rest)
        except PeerGone:  # the socket is going; its close aborts the rest
            return
        if self.streams.get(stream.context_id) is stream:
            del self.streams[stream.context_id]
