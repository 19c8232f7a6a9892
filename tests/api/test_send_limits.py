"""Sending within limits (``api.send_limits``), on a real uvicorn server with the server's own
protocol classes, over loopback: a client that reads gets every byte in order; one that stops
reading is cut (its connection dropped, its body iterator closed) by the send timeout, the
stream buffer or the process's held-audio budget, whichever comes first, and nothing stays held."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn

from api.connection_limits import ConnectionGate, gated_protocols
from api.send_limits import HeldAudio, Hold, SendLimits, send_body
from api.streaming import WholeAudioResponse

PIECE = 64 * 1024


class App:
    """``/stream?n=N&delay=S``: N pieces of 64 KB (piece i filled with byte i % 251), one every S
    seconds; ``/whole?n=N``: the same bytes as one whole response."""

    def __init__(self, limits: SendLimits) -> None:
        self.limits = limits
        self.closed: list[str] = []  # paths whose body iterator was closed before its end
        self.cuts: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        query = dict(part.split("=") for part in scope["query_string"].decode().split("&") if part)
        n, delay = int(query.get("n", 1)), float(query.get("delay", 0))
        if scope["path"] == "/whole":
            hold = Hold(self.limits.held)
            body = b"".join(_piece(i) for i in range(n))
            assert hold.add(len(body))
            await WholeAudioResponse(body, media_type="application/octet-stream", headers={},
                                     limits=self.limits, holds=(hold,))(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send_body(self._pieces(scope["path"], n, delay), scope, receive, send, self.limits)

    async def _pieces(self, path: str, n: int, delay: float):
        finished = False
        try:
            for i in range(n):
                if delay:
                    await asyncio.sleep(delay)
                yield _piece(i)
            finished = True
        finally:
            if not finished:
                self.closed.append(path)


def _piece(i: int) -> bytes:
    return bytes([i % 251]) * PIECE


@pytest.fixture
def serve():
    """``serve(max_buffered=..., held=..., send_timeout_s=...) -> (app, port)``: a server until
    the test ends."""
    servers = []

    def start(*, max_buffered: int = 1 << 30, held: int = 1 << 30, send_timeout_s: float = 1.0):
        app = App(None)  # type: ignore[arg-type]
        app.limits = SendLimits(send_timeout_s, max_buffered, HeldAudio(held), app.cuts.append)
        gate = ConnectionGate(64, 0, linger_s=send_timeout_s)
        protocols = gated_protocols(SimpleNamespace(header_timeout_s=10.0), gate)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="on", **protocols))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        servers.append((server, thread))
        return app, port

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def request(port: int, path: str, *, read: bool) -> socket.socket:
    sock = socket.socket()
    if not read:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


def body_of(sock: socket.socket) -> tuple[bytes, bool]:
    """The response body (chunked framing removed) and whether it ended properly."""
    data = b""
    sock.settimeout(30)
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 20):
            data += chunk
            if data.endswith(b"\r\n0\r\n\r\n") or _whole(data):
                break
    head, _, rest = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        return rest, len(rest) == length
    body, complete = b"", False
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            complete = True
            break
        body, rest = body + rest[:size], rest[size + 2:]
    return body, complete


def _whole(data: bytes) -> bool:
    head, sep, rest = data.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    return bool(sep and lines) and len(rest) >= int(lines[0].split(b":")[1])


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.mark.parametrize("path", ["/stream?n=200", "/whole?n=200"])
def test_a_client_that_reads_gets_every_byte_in_order(serve, path):
    app, port = serve()
    with request(port, path, read=True) as sock:
        body, complete = body_of(sock)
    assert complete and body == b"".join(_piece(i) for i in range(200))
    wait_for(lambda: app.limits.held.bytes == 0)
    assert app.cuts == [] and app.closed == []


@pytest.mark.parametrize("path", ["/stream?n=400&delay=0.005", "/whole?n=400"])
def test_a_client_that_stops_reading_is_cut_after_the_send_timeout(serve, path):
    """25 MB, more than the socket buffers take, to a client that reads nothing: within the
    stream buffer, so the send timeout cuts it; the server drops the connection itself (the
    client sees an unfinished body while it still holds its socket) and holds nothing after."""
    app, port = serve(send_timeout_s=1.0)
    with request(port, path, read=False) as sock:
        wait_for(lambda: app.cuts == ["api.send_timeout_s"])
        body, complete = body_of(sock)
    assert not complete and len(body) < 400 * PIECE
    if path.startswith("/stream"):
        assert app.closed == ["/stream"]  # its producer stopped: no audio made for nobody
    wait_for(lambda: app.limits.held.bytes == 0)


def test_a_stream_past_its_buffer_is_cut_at_once(serve):
    app, port = serve(max_buffered=2 << 20, send_timeout_s=60.0)
    with request(port, "/stream?n=400", read=False) as sock:
        wait_for(lambda: app.cuts == ["api.max_stream_buffer_bytes"], timeout_s=10)
        body, complete = body_of(sock)
    assert not complete
    assert app.closed == ["/stream"]
    wait_for(lambda: app.limits.held.bytes == 0)


def test_past_the_held_budget_the_lagging_stream_is_cut_and_the_reading_one_goes_on(serve):
    """The process may hold 4 MB unsent: a client that reads nothing lags and is cut; one that
    reads as fast as it can, served at the same time, gets all 25 MB."""
    app, port = serve(held=4 << 20, send_timeout_s=60.0)
    with request(port, "/stream?n=400&delay=0.002", read=False) as lagging, \
            request(port, "/stream?n=400&delay=0.002", read=True) as reading:
        body, complete = body_of(reading)
        assert complete and len(body) == 400 * PIECE
        assert app.cuts == ["api.max_held_audio_bytes"]
        assert not body_of(lagging)[1]
    wait_for(lambda: app.limits.held.bytes == 0)


def test_a_closed_connection_still_flushing_to_a_client_that_does_not_read_is_dropped():
    """The gate drops a connection that was closed but still flushes after linger_s."""

    async def main() -> None:
        gate = ConnectionGate(8, 0, linger_s=0.5)
        closed = asyncio.Event()

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                self.transport = transport
                assert gate.admit(transport) is None
                transport.write(b"x" * (32 << 20))  # far more than any socket buffer takes
                transport.close()  # waits to flush: forever, for a client that does not read

            def connection_lost(self, exc) -> None:
                gate.release(self.transport)
                closed.set()

        server = await asyncio.get_running_loop().create_server(Protocol, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            sock.connect(("127.0.0.1", port))
        try:
            await asyncio.wait_for(closed.wait(), 10)
            assert gate.open == 0
        finally:
            sock.close()
            server.close()

    asyncio.run(main())
