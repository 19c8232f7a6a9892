"""What the server holds for a client that reads slowly, or not at all.

The engine makes audio faster than most clients take it, and a client that stops reading does
not stop the engine: without a bound, a stream's whole audio would wait in the API process for a
socket nobody reads. So an audio response is written by :func:`send_body`:

- the body iterator runs ahead of the socket (its engine request is never held up by the
  client), and what it made but the client has not taken yet is counted: past
  ``api.max_stream_buffer_bytes`` the response is cut; and when the process as a whole would hold
  more than ``api.max_held_audio_bytes`` (``HeldAudio``: every response's unsent bytes), the
  stream with the most unsent bytes is cut (one whose client keeps up, with nothing unsent, never
  is; a whole file that cannot be held is a 503 instead);
- each write must be taken within ``api.send_timeout_s``, else the response is cut.

A cut response stops its body iterator (which aborts its engine request), drops the connection
at once (unsent bytes discarded: a client sees a truncated body, never a complete-looking one)
and is counted in ``mossvox_limit_hits_total`` under the limit's field. Dropping needs the
connection itself: the server's HTTP protocol (``api.connection_limits``) puts an abort function
in each request's scope (``ABORT_EXTENSION``); without one (another ASGI server) the cut is
raised, and the server closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.types import Receive, Scope, Send

ABORT_EXTENSION = "mossvox.abort_connection"  # scope["extensions"][...]: () -> None, drops the socket now
PIECE_BYTES = 256 * 1024  # a whole body is written in pieces this large, each within the send timeout


class HeldAudio:
    """Bytes of audio this API process made for clients and has not sent yet (all responses),
    and the streams that hold them: past the limit, the stream that lags most is cut."""

    def __init__(self, limit: int, on_change: Callable[[int], None] = lambda delta: None) -> None:
        """``on_change(delta)`` follows the count (a gauge)."""
        self.limit = limit
        self.bytes = 0
        self._on_change = on_change
        self._streams: set[_Writer] = set()

    def take(self, n: int, *, force: bool = False) -> bool:
        """Count ``n`` more bytes: False (not counted) when that passes the limit, unless
        ``force``."""
        if not force and self.bytes + n > self.limit:
            return False
        self.bytes += n
        self._on_change(n)
        return True

    def give_back(self, n: int) -> None:
        if n:
            self.bytes -= n
            self._on_change(-n)

    def take_for(self, stream: "_Writer", n: int) -> None:
        """Count ``n`` bytes ``stream`` queues; past the limit, the stream with the most unsent
        bytes is cut (``ResponseCut`` here when that is ``stream``; a stream with nothing unsent,
        whose client keeps up, is never cut)."""
        if self.bytes + n > self.limit:
            laggard = max(self._streams, key=lambda other: other.pending_bytes, default=None)
            if laggard is not None and laggard.pending_bytes > stream.pending_bytes:
                laggard.cut(_held_cut())
            elif stream.pending_bytes:
                raise _held_cut()
        self.take(n, force=True)


def _held_cut() -> "ResponseCut":
    return ResponseCut("api.max_held_audio_bytes",
                       "the server holds too much unsent audio; the client that lags most is cut")


class Hold:
    """The bytes one whole response holds in ``HeldAudio`` until it is sent; ``release`` gives
    them back (once, however often it is called)."""

    def __init__(self, held: HeldAudio) -> None:
        self.held = held
        self.bytes = 0

    def add(self, n: int) -> bool:
        """Hold ``n`` more bytes; False (not held) when the process holds too much already."""
        if not self.held.take(n, force=not self.bytes):  # a response's first piece always goes
            return False
        self.bytes += n
        return True

    def release(self) -> None:
        self.held.give_back(self.bytes)
        self.bytes = 0


@dataclass(frozen=True)
class SendLimits:
    """This process's bounds on sending (built from the profile by ``api.app``)."""

    send_timeout_s: float  # api.send_timeout_s
    max_buffered: int  # api.max_stream_buffer_bytes
    held: HeldAudio  # api.max_held_audio_bytes
    on_cut: Callable[[str], None]  # counts a cut by its limit's field


class ResponseCut(Exception):
    """A response stopped by a send limit (``limit``: its profile field)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


async def send_body(body: AsyncIterator[bytes], scope: Scope, receive: Receive, send: Send,
                    limits: SendLimits) -> None:
    """Write ``body`` after the response start was sent, within ``limits`` (the module
    docstring). Returns when the body is sent, or the connection was dropped by a cut; raises
    what the body iterator raises."""
    try:
        await _Writer(body, send, limits).run()
    except ResponseCut as cut:
        limits.on_cut(cut.limit)
        await abort_connection(scope, receive, cut)


async def send_whole(body: bytes, scope: Scope, receive: Receive, send: Send, limits: SendLimits) -> None:
    """Write a body already made (after the response start), in pieces, each within the send
    timeout; a client that does not take one has its connection dropped (counted)."""
    try:
        for piece in _pieces(body):
            await _send_within(send, {"type": "http.response.body", "body": piece, "more_body": True},
                               limits.send_timeout_s)
        await _send_within(send, {"type": "http.response.body", "body": b"", "more_body": False},
                           limits.send_timeout_s)
    except ResponseCut as cut:
        limits.on_cut(cut.limit)
        await abort_connection(scope, receive, cut)


async def _send_within(send: Send, message: dict, timeout_s: float) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await send(message)
    except TimeoutError:
        raise ResponseCut("api.send_timeout_s", "the client took nothing for the send timeout") from None


async def abort_connection(scope: Scope, receive: Receive, cut: ResponseCut) -> None:
    """Drop the client's connection now; raise ``cut`` where the server gives no way to."""
    abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
    if abort is None:
        raise cut
    abort()
    with contextlib.suppress(TimeoutError):  # the server notices the socket is gone
        async with asyncio.timeout(5):
            while (await receive())["type"] != "http.disconnect":
                pass


class _Writer:
    """The body read ahead into a queue of unsent pieces, written to the client as it takes them."""

    def __init__(self, body: AsyncIterator[bytes], send: Send, limits: SendLimits) -> None:
        self.body, self.send, self.limits = body, send, limits
        self.pending: deque[bytes] = deque()
        self.pending_bytes = 0
        self.wake = asyncio.Event()  # a piece queued, the body ended, or this response was cut
        self.finished = False
        self._cut: ResponseCut | None = None
        self._producer: asyncio.Future | None = None

    def cut(self, reason: ResponseCut) -> None:
        """Stop this response (another stream needs the held budget): its writer raises ``reason``."""
        if self._cut is None:
            self._cut = reason
            if self._producer is not None:
                self._producer.cancel()
            self.wake.set()

    async def run(self) -> None:
        held = self.limits.held
        held._streams.add(self)
        self._producer = producer = asyncio.ensure_future(self._produce())
        try:
            while True:
                self._raise_failure()
                if not self.pending:
                    if self.finished:
                        break
                    self.wake.clear()
                    waiter = asyncio.ensure_future(self.wake.wait())
                    try:
                        await asyncio.wait({waiter, producer}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                    continue
                piece = self.pending.popleft()
                try:
                    await self._send_timed({"type": "http.response.body", "body": piece, "more_body": True})
                finally:
                    self.pending_bytes -= len(piece)
                    held.give_back(len(piece))
            self._raise_failure()  # what the body raised after its last piece
            await self._send_timed({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            held._streams.discard(self)
            if not producer.done():
                producer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await producer
            held.give_back(self.pending_bytes)
            self.pending_bytes = 0
            self.pending.clear()

    def _raise_failure(self) -> None:
        if self._cut is not None:
            raise self._cut
        _raise_failure(self._producer)

    async def _produce(self) -> None:
        try:
            async for chunk in self.body:
                for piece in _pieces(chunk):
                    self._queue(piece)
        except BaseException:
            aclose = getattr(self.body, "aclose", None)
            if aclose is not None:  # stop its engine request now, not when the writer notices
                with contextlib.suppress(Exception):
                    await aclose()
            raise
        finally:
            self.finished = True
            self.wake.set()

    def _queue(self, piece: bytes) -> None:
        if self.pending_bytes + len(piece) > self.limits.max_buffered:
            raise ResponseCut("api.max_stream_buffer_bytes",
                              f"the client took too little of its audio: {self.pending_bytes} bytes unsent")
        self.limits.held.take_for(self, len(piece))
        self.pending.append(piece)
        self.pending_bytes += len(piece)
        self.wake.set()

    async def _send_timed(self, message: dict) -> None:
        """``send(message)`` within the send timeout; stops early when the response fails or is cut."""
        sending = asyncio.ensure_future(self.send(message))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.send_timeout_s
        try:
            while not sending.done():
                waits = {sending} if self._producer.done() else {sending, self._producer}
                await asyncio.wait(waits, timeout=max(0.0, deadline - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if sending.done():
                    break
                self._raise_failure()
                if loop.time() >= deadline:
                    raise ResponseCut("api.send_timeout_s", "the client took nothing for the send timeout")
            sending.result()
        finally:
            if not sending.done():
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sending


def _raise_failure(producer: asyncio.Future) -> None:
    if producer.done() and not producer.cancelled() and producer.exception() is not None:
        raise producer.exception()


def _pieces(chunk: bytes) -> list[bytes]:
    if len(chunk) <= PIECE_BYTES:
        return [chunk] if chunk else []
    view = memoryview(chunk)
    return [bytes(view[i:i + PIECE_BYTES]) for i in range(0, len(chunk), PIECE_BYTES)]
