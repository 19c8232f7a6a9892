"""An ASGI response that streams an async byte iterator and stops it when the client leaves.

Starlette's ``StreamingResponse`` only watches for disconnects on ASGI servers older than spec
2.4; newer ones report a disconnect only when the next write fails, which for audio can be a
whole chunk later. This response always watches ``receive`` next to the writer, so a client
that goes away cancels the body iterator at once (its ``aclose`` aborts the engine request).
An exception raised by the iterator after the headers went out propagates, so the server cuts
the connection instead of finishing the body: the client sees a truncated stream. A `StreamCut`
is such a cut on purpose (the engine could not finish the request; the route logged it in one
line): `quiet_stream_cuts` keeps the server from logging it as an unhandled error with a
traceback. With
``SendLimits`` (``api.send_limits``) the body runs ahead of the socket and a client that reads
too slowly, or not at all, is cut; ``WholeAudioResponse`` sends a body made whole within the same
send timeout, and gives back what it held once sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from api.send_limits import Hold, SendLimits, send_body, send_whole


class AudioStreamResponse(StreamingResponse):
    def __init__(self, body: AsyncIterator[bytes], *, media_type: str, headers: dict[str, str],
                 limits: SendLimits | None = None) -> None:
        super().__init__(body, media_type=media_type, headers=headers)
        self.body_iterator = body  # the generator itself, so closing it runs its cleanup
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with contextlib.aclosing(self.body_iterator):  # type: ignore[type-var]
            with contextlib.suppress(ClientGone):
                await run_until_disconnect(self._write(scope, receive, send), receive)

    async def _write(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if self.limits is not None:
            await send_body(self.body_iterator, scope, receive, send, self.limits)
            return
        async for chunk in self.body_iterator:
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class WholeAudioResponse(Response):
    """A body made whole (an audio file, a batch's JSON), sent in pieces within the send timeout;
    ``holds`` (what it holds of ``api.max_held_audio_bytes``) are given back once it is sent or
    dropped."""

    def __init__(self, content: bytes, *, media_type: str, headers: dict[str, str], limits: SendLimits,
                 holds: tuple[Hold, ...] = ()) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self.limits, self.holds = limits, holds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send_whole(self.body, scope, receive, send, self.limits)
        finally:
            for hold in self.holds:
                hold.release()


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(work: Awaitable, receive: Receive | Callable) -> object:
    """Run ``work``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    return task.result()


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


class StreamCut(Exception):
    """Raised into the server after audio started, so it drops the connection mid-body (the
    client sees an incomplete chunked body: the HTTP way to say a response failed midway)."""


class _StreamCutFilter(logging.Filter):
    """Drops the server's "Exception in ASGI application" record of a `StreamCut`."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, StreamCut)


def quiet_stream_cuts(logger_name: str = "uvicorn.error") -> None:
    """Keep the ASGI server's logger from reporting a `StreamCut` as an unhandled error (once per
    process; the cut is logged by the route that made it)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _StreamCutFilter) for f in logger.filters):
        logger.addFilter(_StreamCutFilter())
