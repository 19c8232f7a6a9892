"""Read timeouts for HTTP connections: a client that stalls is disconnected, not waited for.

uvicorn closes an idle keep-alive connection but waits forever for headers that never finish and
for a body that stops arriving. Two guards close that gap:

- ``header_timeout_protocol(seconds)``: uvicorn's h11 protocol, closing a connection whose request
  headers are not complete ``seconds`` after it opened (or after its previous response ended);
- ``BodyTimeoutMiddleware``: a 408 (and the connection closed) when the next piece of a request
  body takes longer than ``gap_s`` (``api.body_timeout_s``) to arrive, or the whole body is not
  in ``total_s`` (``api.body_deadline_s``) after the headers, however steadily it trickles. Once
  the body is complete, ``receive`` is not timed: a streaming response waits on it for the
  client's disconnect.

Together with the connection caps (``api.connection_limits``) they bound how long and how many
descriptors slow clients hold.
"""

from __future__ import annotations

import asyncio

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from api.errors import ApiError


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` with a request-header timeout."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # before: the base class may already parse a pipelined request
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(seconds, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


class BodyTimeoutMiddleware:
    """408 when a request body stalls for ``gap_s`` or is not whole after ``total_s`` (see the
    module docstring)."""

    def __init__(self, app: ASGIApp, gap_s: float, total_s: float) -> None:
        self.app = app
        self.gap_s = gap_s
        self.total_s = total_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_s
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            left = deadline - loop.time()
            gap = left >= self.gap_s
            try:
                async with asyncio.timeout(min(self.gap_s, max(left, 0.0))):
                    message = await receive()
            except TimeoutError:
                raise self._too_slow(gap) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, send)

    def _too_slow(self, gap: bool) -> ApiError:
        if gap:
            message, limit = f"The request body stalled for {self.gap_s:g} s (api.body_timeout_s)", "api.body_timeout_s"
        else:
            message, limit = (f"The request body was not complete {self.total_s:g} s after its headers "
                              f"(api.body_deadline_s)", "api.body_deadline_s")
        return ApiError(408, message, headers={"Connection": "close"}, limit=limit)
