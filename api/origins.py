"""Pages on other origins are kept out of everything that acts: the WebSocket and every route that
changes state.

A browser attaches an ``Origin`` header to a WebSocket handshake and to every cross-origin
request that is not a plain GET, and lets a page on any origin open a WebSocket or send a form or
``text/plain`` POST without asking the server first. With no API key (the default), any page a
user of the server visits could otherwise speak through it, read the audio, or overwrite a
registered voice. :class:`OriginCheckMiddleware` refuses, before anything else runs:

- a WebSocket handshake (close 1008: HTTP 403), and
- a ``POST``, ``PUT``, ``PATCH`` or ``DELETE`` (403 in the OpenAI envelope, code
  ``origin_not_allowed``)

whose ``Origin`` is neither the server's own (its scheme's host and port as the ``Host`` header
names them: the demo page, or a proxy in front that keeps ``Host``) nor listed in
``api.cors_origins`` (``*`` allows every origin). A request without ``Origin`` is not from a
browser page and passes (API clients, curl); ``Origin: null`` (sandboxed frames, files) is
refused unless ``null`` is listed. Reads (GET) are left to CORS: without CORS headers a page
cannot read the answer.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import error_body_for

UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` (scheme://host[:port]) names the server the ``Host`` header names: the
    same host, and the same port when ``Host`` states one (else the origin's scheme's default)."""
    if not host:
        return False
    try:
        parts = urlsplit(origin)
        origin_port = parts.port or DEFAULT_PORTS.get(parts.scheme)
        wanted = urlsplit(f"//{host}")
        host_port = wanted.port
    except ValueError:
        return False
    if not parts.hostname or not wanted.hostname or parts.hostname != wanted.hostname:
        return False
    return origin_port == host_port if host_port is not None else parts.port is None


class OriginCheckMiddleware:
    """403 / close 1008 for a browser page of another origin (see the module docstring)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app = app
        self.allow_all = "*" in allowed
        self.allowed = frozenset(o.rstrip("/").lower() for o in allowed)

    def allows(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is None or self.allow_all:
            return True
        text = origin.decode("latin-1").strip().rstrip("/").lower()
        return text in self.allowed or same_origin(text, headers.get(b"host", b"").decode("latin-1").lower())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            if not self.allows(scope):
                await send({"type": "websocket.close", "code": 1008, "reason": "origin not allowed"})
                return
        elif scope["type"] == "http" and scope["method"] in UNSAFE_METHODS and not self.allows(scope):
            body = error_body_for(scope["path"], 403, "Requests from this page's origin are not allowed "
                                  "(api.cors_origins)", code="origin_not_allowed")
            await JSONResponse(body, status_code=403)(scope, receive, send)
            return
        await self.app(scope, receive, send)
