"""Open connections per API process and per client address, bounded before a byte is read.

uvicorn accepts every connection the kernel hands it; thousands of sockets that trickle a request
would take every file descriptor the process has, and then nothing, not even ``/health``, is
served. :class:`ConnectionGate` counts this process's open connections, in all and by the peer's
address, and refuses one past ``api.max_connections`` (never more than the descriptors the
process may open, less a reserve for its own files) or past ``api.max_connections_per_address``:
it writes a 503 in the OpenAI envelope with ``Connection: close`` and ``Retry-After`` and closes
the socket at once, so a refused connection holds its descriptor for no time. The count follows
the transport, so a connection upgraded to a WebSocket stays counted until its socket closes. A
connection closed with bytes its client never reads would wait to flush them forever: the gate
drops one still flushing ``linger_s`` (``api.send_timeout_s``) after it was closed.

``gated_protocols(profile, gate)`` gives the HTTP and WebSocket protocol classes for
``uvicorn.Config(http=..., ws=...)``: the gate on both, and on HTTP the request-header timeout
(``api.http_timeouts.header_timeout_protocol``) and, in each request's scope, the function that
drops its connection (``api.send_limits.ABORT_EXTENSION``: a response cut for a client that does
not read is not left to flush forever).

The address is the socket's peer: behind a proxy or load balancer every client shares the
proxy's few addresses, so there ``api.max_connections_per_address`` must allow the proxy's
connections (or be 0: off).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import Counter
from collections.abc import Callable

from api.errors import error_body
from api.http_timeouts import header_timeout_protocol
from api.send_limits import ABORT_EXTENSION

log = logging.getLogger("mossvox.api")

FD_RESERVE = 256  # descriptors kept for the process's own files: rings, metrics, logs, references


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def refusal_response(message: str, code: str) -> bytes:
    """A whole HTTP/1.1 503 response (the OpenAI envelope), written before any request is read."""
    body = json.dumps(error_body(503, message, code=code)).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class ConnectionGate:
    """This process's open connections: ``admit`` on connect (refusing past a cap), ``release``
    when the socket closes (idempotent: an upgraded connection is released once)."""

    def __init__(self, max_open: int, max_per_address: int, linger_s: float = 30.0) -> None:
        """``max_per_address`` 0 = no per-address cap; ``linger_s``: how long a closed connection
        may go on flushing before it is dropped."""
        self.max_open = max_open
        self.max_per_address = max_per_address
        self.linger_s = linger_s
        self.open = 0
        self._by_address: Counter[str] = Counter()
        self._admitted: dict[int, tuple[asyncio.BaseTransport, str]] = {}  # id(transport) -> it, its address
        self._closing_since: dict[int, float] = {}
        self._reaper: asyncio.TimerHandle | None = None
        self._on_change: Callable[[int], None] = lambda delta: None
        self._on_refused: Callable[[str], None] = lambda limit: None

    @classmethod
    def for_process(cls, api_config) -> "ConnectionGate":
        """The gate of an API process: ``api.max_connections`` within the descriptors it may
        open (the soft limit raised to the hard one first)."""
        fds = raise_fd_limit()
        allowed = max(16, fds - FD_RESERVE)
        if api_config.max_connections > allowed:
            log.warning("api.max_connections %d is more than this process may open (RLIMIT_NOFILE %d less "
                        "%d reserved): capped at %d", api_config.max_connections, fds, FD_RESERVE, allowed)
        return cls(min(api_config.max_connections, allowed), api_config.max_connections_per_address,
                   linger_s=api_config.send_timeout_s)

    def bind(self, on_change: Callable[[int], None], on_refused: Callable[[str], None]) -> None:
        """Report open-count changes (``on_change(+1 | -1)``) and refusals (``on_refused(limit)``),
        starting from the connections open now."""
        self._on_change, self._on_refused = on_change, on_refused
        if self.open:
            on_change(self.open)

    def admit(self, transport: asyncio.BaseTransport) -> str | None:
        """Count a new connection; or, past a cap, the profile field of that cap (not counted)."""
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if self.open >= self.max_open:
            return self._refuse("api.max_connections")
        if self.max_per_address and self._by_address[address] >= self.max_per_address:
            return self._refuse("api.max_connections_per_address")
        self.open += 1
        self._by_address[address] += 1
        self._admitted[id(transport)] = (transport, address)
        self._on_change(1)
        if self._reaper is None:
            self._schedule_reaper()
        return None

    def release(self, transport: asyncio.BaseTransport) -> None:
        admitted = self._admitted.pop(id(transport), None)
        self._closing_since.pop(id(transport), None)
        if admitted is None:
            return
        address = admitted[1]
        self.open -= 1
        self._by_address[address] -= 1
        if not self._by_address[address]:
            del self._by_address[address]
        self._on_change(-1)

    def _schedule_reaper(self) -> None:
        loop = asyncio.get_running_loop()
        self._reaper = loop.call_later(max(0.5, self.linger_s / 2), self._reap)

    def _reap(self) -> None:
        """Drop the connections closed ``linger_s`` ago and still flushing to a client that does
        not read."""
        now = asyncio.get_running_loop().time()
        for key, (transport, _) in list(self._admitted.items()):
            if not transport.is_closing():
                continue
            since = self._closing_since.setdefault(key, now)
            if now - since >= self.linger_s:
                transport.abort()  # its protocol's connection_lost releases it
        self._schedule_reaper()

    def _refuse(self, limit: str) -> str:
        self._on_refused(limit)
        return limit

    def refuse(self, transport: asyncio.Transport, limit: str) -> None:
        """Answer a connection refused by ``limit`` with a 503 and close it."""
        cap = self.max_open if limit == "api.max_connections" else self.max_per_address
        scope = "this server process" if limit == "api.max_connections" else "one client address"
        message = f"{scope} holds {cap} open connections already ({limit}); try again later"
        try:
            transport.write(refusal_response(message, "too_many_connections"))
        finally:
            transport.close()


def gated_protocols(api_config, gate: ConnectionGate) -> dict[str, type]:
    """``http`` and ``ws`` protocol classes for ``uvicorn.Config``: counted by ``gate``, and the
    HTTP one with the request-header timeout (``api.header_timeout_s``)."""
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    base_http = header_timeout_protocol(api_config.header_timeout_s)

    class GatedHttpProtocol(base_http):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:  # type: ignore[override]
            refused = gate.admit(transport)
            if refused is not None:
                gate.refuse(transport, refused)
                return
            super().connection_made(transport)

        def handle_events(self) -> None:
            super().handle_events()
            if self.scope is not None and ABORT_EXTENSION not in self.scope.get("extensions", {}):
                # the request just parsed (its task has not run yet) may drop its connection
                self.scope.setdefault("extensions", {})[ABORT_EXTENSION] = self.transport.abort

        def data_received(self, data: bytes) -> None:
            if self.transport is None:  # refused: closing, nothing to parse
                return
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.transport is None:  # refused before it was set up
                return
            gate.release(self.transport)
            super().connection_lost(exc)

    protocols: dict[str, type] = {"http": GatedHttpProtocol}
    if AutoWebSocketsProtocol is not None:
        base_ws: type = AutoWebSocketsProtocol  # type: ignore[assignment]

        class GatedWebSocketProtocol(base_ws):  # type: ignore[misc, valid-type]
            def connection_lost(self, exc: Exception | None) -> None:
                gate.release(self.transport)  # the upgraded connection's socket is closing
                super().connection_lost(exc)

        protocols["ws"] = GatedWebSocketProtocol
    return protocols
