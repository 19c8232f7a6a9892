"""API-key access control for ``/v1/*`` (``--api-key`` or profile ``api.keys``).

``/health``, ``/ready``, ``/metrics``, ``/openapi.json`` and the demo page stay open. A key comes
as ``Authorization: Bearer <key>`` or, as ElevenLabs clients send it, ``xi-api-key: <key>``. A
missing or wrong key is a 401 (in the error shape of the route: `api.errors.error_body_for`).
Pure ASGI middleware, so streaming responses pass through untouched.

WebSockets under ``/v1/`` take the same keys, from those headers or, since browsers cannot set
headers on a WebSocket, from an ``api_key`` query parameter (or ElevenLabs' ``authorization``); a
missing or wrong key closes the handshake (HTTP 403) before the socket is accepted. ElevenLabs'
sockets may instead carry the key in their first message: a handshake to one of
``FIRST_MESSAGE_KEY_PATHS`` with no key at all is let through with a `KeyCheck` in its scope
(``scope[DEFERRED_KEY_CHECK]``), and the socket's first message must pass it
(`api.elevenlabs_session`).
"""

from __future__ import annotations

import hmac
import re
from urllib.parse import parse_qs

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import error_body_for

PROTECTED_PREFIX = "/v1/"
DEFERRED_KEY_CHECK = "mossvox.deferred_key_check"
# the sockets whose protocol lets the key come in the first message instead of the handshake
FIRST_MESSAGE_KEY_PATHS = re.compile(r"^/v1/text-to-speech/[^/]+/(multi-)?stream-input$")


class KeyCheck:
    """Whether a key is one of the server's (constant time against each)."""

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys

    def __call__(self, token: bytes) -> bool:
        token = token.strip()
        return bool(token) and any(hmac.compare_digest(token, key) for key in self.keys)


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.check = KeyCheck(tuple(k.encode() for k in keys if k))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] not in ("http", "websocket") or not self.check.keys
                or not scope["path"].startswith(PROTECTED_PREFIX)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            given = self._given(scope, query_key=True)
            if given is None and FIRST_MESSAGE_KEY_PATHS.match(scope["path"]):
                scope[DEFERRED_KEY_CHECK] = self.check
                await self.app(scope, receive, send)
                return
            problem = self._problem(given)
            if problem is None:
                await self.app(scope, receive, send)
            else:
                await send({"type": "websocket.close", "code": 1008, "reason": problem[:120]})
            return
        problem = self._problem(self._given(scope))
        if problem is None:
            await self.app(scope, receive, send)
            return
        body = error_body_for(scope["path"], 401, problem, code="invalid_api_key")
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    @staticmethod
    def _given(scope: Scope, query_key: bool = False) -> bytes | None:
        """The credential the request carries, as an ``Authorization`` value, or None."""
        headers = dict(scope["headers"])
        if b"authorization" in headers:
            return headers[b"authorization"]
        if b"xi-api-key" in headers:
            return b"Bearer " + headers[b"xi-api-key"]
        if query_key:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            if query.get("api_key"):
                return b"Bearer " + query["api_key"][0].encode()
            if query.get("authorization"):
                value = query["authorization"][0]
                return (value if value.lower().startswith("bearer ") else f"Bearer {value}").encode()
        return None

    def _problem(self, given: bytes | None) -> str | None:
        if given is None:
            return "Missing API key: send 'Authorization: Bearer <key>' or 'xi-api-key: <key>'"
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return "Malformed Authorization header: expected 'Bearer <key>'"
        if not self.check(token):
            return "Incorrect API key provided"
        return None
