"""`WS /v1/audio/speech/stream`: text in as it is written, audio out as it is made.

The endpoint accepts the socket (the API key was checked by `api.auth` before), holds one of this
process's `stream.max_sessions` places, and reads client messages until the session ends: each
goes to the `SpeechSession`. Bounds, so that one client cannot hold the server:
- a message larger than `api.max_body_bytes` closes the socket (1009, uvicorn's `ws_max_size`);
- a session that sends nothing for `stream.idle_timeout_s` while nothing is being spoken is
  closed (an error frame, then 1000);
- a client that does not take a frame for `stream.send_timeout_s` is dropped
  (`api.stream_output`);
- however the session ends (closed by the client, dropped, idle, `session.close`, or a bug:
  logged, an `internal_error` frame, close 1011), whatever it was still speaking is aborted in
  every stage and its place is given back.
Binary client frames are refused with an error frame. The protocol is in `api.stream_protocol`.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from api.errors import ApiError, bad_request
from api.stream_output import Outbound, PeerGone
from api.stream_protocol import OmniEvents, decode_message, error_event
from api.stream_session import SpeechSession

log = logging.getLogger("mossvox.api")

CLOSE_NORMAL, CLOSE_INTERNAL_ERROR, CLOSE_TRY_LATER = 1000, 1011, 1013


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
    """One session, from the accepted socket to its close (see the module docstring)."""
    state = websocket.state.api
    limits = state.profile.stream
    await websocket.accept()
    out = Outbound(websocket, limits.send_timeout_s)
    if not state.streams.take():
        await _refuse(out, ApiError(
            503, f"this server holds {state.streams.limit} speech sessions already "
                 f"(stream.max_sessions); try again later", code="too_many_sessions"))
        return
    session = SpeechSession(state, OmniEvents(out))
    try:
        await _serve(websocket, out, session, limits.idle_timeout_s)
    except (WebSocketDisconnect, PeerGone):
        pass
    finally:
        await session.close()
        state.streams.give_back()


async def _serve(websocket: WebSocket, out: Outbound, session: SpeechSession, idle_s: float) -> None:
    """Client messages to the session until it ends; returns at once when the peer is gone
    (a send failed or timed out), even while nothing is being received."""
    gone = asyncio.ensure_future(out.gone_event.wait())
    receive: asyncio.Future | None = None
    try:
        while True:
            if receive is None:
                receive = asyncio.ensure_future(websocket.receive())
            done, _ = await asyncio.wait((receive, gone), timeout=idle_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                return
            if receive not in done:  # nothing for idle_s
                if session.busy:
                    continue
                await _refuse(out, ApiError(
                    400, f"no message for {idle_s:g} s (stream.idle_timeout_s): closing",
                    code="idle_timeout"), code=CLOSE_NORMAL)
                return
            message, receive = receive.result(), None
            if not await _handle(message, out, session):
                return
    finally:
        for future in (receive, gone):
            if future is not None:
                future.cancel()


async def _handle(message: dict, out: Outbound, session: SpeechSession) -> bool:
    """One received ASGI message; False once the session is over."""
    if message["type"] == "websocket.disconnect":
        return False
    text = message.get("text")
    if text is None:
        await out.send_json(error_event(bad_request("binary frames are not accepted: send "
                                                    "JSON text messages")))
        return True
    try:
        msg = decode_message(text)
    except ApiError as exc:
        await out.send_json(error_event(exc))
        return True
    try:
        goes_on = await session.handle(msg)
    except Exception:  # a bug: the session's state is not to be trusted any more
        log.exception("speech session: %s failed", msg.type)
        await _refuse(out, ApiError(500, f"internal error handling {msg.type}; the session is "
                                         f"closed (the server log has the details)",
                                    code="internal_error"), code=CLOSE_INTERNAL_ERROR)
        return False
    if not goes_on:
        await out.close(CLOSE_NORMAL)
    return goes_on


async def _refuse(out: Outbound, error: ApiError, code: int = CLOSE_TRY_LATER) -> None:
    """An error frame, then the socket closed with `code`."""
    try:
        await out.send_json(error_event(error))
    except PeerGone:
        return
    await out.close(code, error.code or "")
