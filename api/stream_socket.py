"""The serving loop every speech WebSocket shares: `serve_socket` and the `SocketSession` a protocol
implements.

`serve_socket` accepts the socket (the API key was checked by `api.auth` before), holds one of this
process's `stream.max_sessions` places (shared by every speech socket), opens the protocol's
`SocketSession` and reads client messages until the session ends. Bounds, so that one client
cannot hold the server:
- a message larger than `api.max_body_bytes` closes the socket (1009, uvicorn's `ws_max_size`);
- a session that sends nothing for its idle timeout (`stream.idle_timeout_s` here) while nothing
  is being spoken is closed (an error message, then the protocol's close code);
- a client that does not take a frame for `stream.send_timeout_s` is dropped
  (`api.stream_output`);
- however the session ends (closed by the client, dropped, idle, closed by a message, or a bug:
  logged, an `internal_error` message, close 1011), whatever it was still speaking is aborted in
  every stage and its place is given back.
Binary client frames are refused with an error message. Each protocol shapes its own messages:
`/v1/audio/speech/stream`'s (`api.routes.speech_stream`), the ElevenLabs-compatible sockets'
(`api.elevenlabs_session`).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

from starlette.websockets import WebSocket, WebSocketDisconnect

from api.errors import ApiError, bad_request, count_limit
from api.stream_output import Outbound, PeerGone

log = logging.getLogger("mossvox.api")

CLOSE_NORMAL, CLOSE_POLICY, CLOSE_INTERNAL_ERROR, CLOSE_TRY_LATER = 1000, 1008, 1011, 1013


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


class SocketSession(ABC):
    """One speech socket's session, as the serving loop sees it; a protocol implements it."""

    idle_s: float                  # close after this long without a message while not busy
    idle_source: str               # what sets idle_s, for the message that closes the socket
    idle_limit: str | None = None  # the profile field, when a server limit sets it (counted)
    idle_close: int = CLOSE_NORMAL  # the close code then

    @property
    @abstractmethod
    def busy(self) -> bool:
        """Speech is queued or being spoken (the idle timeout waits)."""

    @abstractmethod
    def error_message(self, exc: ApiError) -> dict:
        """`exc` as this protocol's error message."""

    async def open(self) -> None:
        """Before the first message: what the handshake asked for, checked; an `ApiError`
        refuses the socket (its message, then close 1008)."""

    @abstractmethod
    async def receive(self, text: str) -> bool:
        """Act on one text message (errors answered by the session); False once the session
        is over (the socket is then closed normally)."""

    @abstractmethod
    async def close(self) -> None:
        """The socket is gone or the session ended: abort whatever is still speaking."""


async def serve_socket(websocket: WebSocket, make_session: Callable[[Outbound], SocketSession]) -> None:
    """One session, from the accepted socket to its close (see the module docstring)."""
    state = websocket.state.api
    await websocket.accept()
    out = Outbound(websocket, state.profile.stream.send_timeout_s)
    session = make_session(out)
    if not state.streams.take():
        refused = ApiError(503, f"this server holds {state.streams.limit} speech sessions already "
                                f"(stream.max_sessions); try again later", code="too_many_sessions",
                           limit="stream.max_sessions")
        count_limit(state, refused)
        await _refuse(out, session.error_message(refused))
        return
    try:
        try:
            await session.open()
        except ApiError as exc:
            await _refuse(out, session.error_message(exc), code=CLOSE_POLICY)
            return
        await _serve(websocket, out, session, state)
    except (WebSocketDisconnect, PeerGone):
        pass
    finally:
        await session.close()
        state.streams.give_back()


async def _serve(websocket: WebSocket, out: Outbound, session: SocketSession, state) -> None:
    """Client messages to the session until it ends; returns at once when the peer is gone
    (a send failed or timed out), even while nothing is being received."""
    gone = asyncio.ensure_future(out.gone_event.wait())
    receive: asyncio.Future | None = None
    try:
        while True:
            if receive is None:
                receive = asyncio.ensure_future(websocket.receive())
            done, _ = await asyncio.wait((receive, gone), timeout=session.idle_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                return
            if receive not in done:  # nothing for idle_s
                if session.busy:
                    continue
                idle = ApiError(400, f"no message for {session.idle_s:g} s ({session.idle_source}): "
                                     f"closing", code="idle_timeout", limit=session.idle_limit)
                count_limit(state, idle)
                await _refuse(out, session.error_message(idle), code=session.idle_close)
                return
            message, receive = receive.result(), None
            if not await _handle(message, out, session):
                return
    finally:
        for future in (receive, gone):
            if future is not None:
                future.cancel()


async def _handle(message: dict, out: Outbound, session: SocketSession) -> bool:
    """One received ASGI message; False once the session is over."""
    if message["type"] == "websocket.disconnect":
        return False
    text = message.get("text")
    if text is None:
        await out.send_json(session.error_message(bad_request(
            "binary frames are not accepted: send JSON text messages")))
        return True
    try:
        goes_on = await session.receive(text)
    except Exception:  # a bug: the session's state is not to be trusted any more
        log.exception("speech session: a message failed")
        await _refuse(out, session.error_message(ApiError(
            500, "internal error handling a message; the session is closed (the server log has "
                 "the details)", code="internal_error")), code=CLOSE_INTERNAL_ERROR)
        return False
    if not goes_on:
        await out.close(CLOSE_NORMAL)
    return goes_on


async def _refuse(out: Outbound, message: dict, code: int = CLOSE_TRY_LATER) -> None:
    """An error message, then the socket closed with `code`."""
    try:
        await out.send_json(message)
    except PeerGone:
        return
    reason = message.get("error", {}).get("code") if isinstance(message.get("error"), dict) else None
    await out.close(code, reason or message.get("error") or "")
