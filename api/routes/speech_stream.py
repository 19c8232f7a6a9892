"""`WS /v1/audio/speech/stream`: text in as it is written, audio out as it is made.

The endpoint accepts the socket (the API key was checked by `api.auth` before), holds one of this
process's `stream.max_sessions` places, and reads client messages until the session ends: each
goes to the `SpeechSession`. A session that sends nothing for `stream.idle_timeout_s` while
nothing is being spoken is closed; a socket closed by the client aborts whatever it was still
speaking. Binary client frames are refused with an error frame. The protocol is in
`api.stream_protocol`.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from api.errors import ApiError, bad_request
from api.stream_output import Outbound, PeerGone
from api.stream_protocol import decode_message, error_event
from api.stream_session import SpeechSession

log = logging.getLogger("mossvox.api")

CLOSE_NORMAL, CLOSE_TRY_LATER = 1000, 1013


class StreamSessions:
    """This API process's open sessions (a count, bounded by `stream.max_sessions`)."""

    def __init__(self, limit: int, gauge) -> None:
        self.limit, self.open, self.gauge = limit, 0, gauge

    def take(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        self.gauge.inc()
        return True

    def give_back(self) -> None:
        self.open -= 1
        self.gauge.dec()


async def speech_stream(websocket: WebSocket) -> None:
    state = websocket.state.api
    await websocket.accept()
    out = Outbound(websocket)
    if not state.streams.take():
        await _refuse(websocket, out, ApiError(
            503, f"this server holds {state.streams.limit} speech sessions already "
                 f"(stream.max_sessions); try again later", code="too_many_sessions"))
        return
    session = SpeechSession(state, out)
    try:
        await _serve(websocket, out, session, state.profile.stream.idle_timeout_s)
    except (WebSocketDisconnect, PeerGone):
        pass
    finally:
        await session.close()
        state.streams.give_back()


async def _serve(websocket: WebSocket, out: Outbound, session: SpeechSession, idle_s: float) -> None:
    while True:
        try:
            message = await asyncio.wait_for(websocket.receive(), idle_s)
        except TimeoutError:
            if session.busy:
                continue
            await _refuse(websocket, out, ApiError(
                400, f"no message for {idle_s:g} s (stream.idle_timeout_s): closing",
                code="idle_timeout"), code=CLOSE_NORMAL)
            return
        if message["type"] == "websocket.disconnect":
            return
        text = message.get("text")
        if text is None:
            await out.send_json(error_event(bad_request("binary frames are not accepted: send "
                                                        "JSON text messages")))
            continue
        try:
            msg = decode_message(text)
        except ApiError as exc:
            await out.send_json(error_event(exc))
            continue
        if not await session.handle(msg):
            await websocket.close(CLOSE_NORMAL)
            return


async def _refuse(websocket: WebSocket, out: Outbound, error: ApiError, code: int = CLOSE_TRY_LATER) -> None:
    try:
        await out.send_json(error_event(error))
        await websocket.close(code, error.code or "")
    except (PeerGone, RuntimeError, WebSocketDisconnect):
        pass
