"""Bearer-key access control for ``/v1/*`` (``--api-key`` or profile ``api.keys``).

``/health``, ``/ready``, ``/metrics``, ``/openapi.json`` and the demo page stay open. A missing
or wrong key is a 401 in the OpenAI envelope. Pure ASGI middleware, so streaming responses pass
through untouched.

WebSockets under ``/v1/`` take the same keys, from the ``Authorization`` header or, since browsers
cannot set headers on a WebSocket, from an ``api_key`` query parameter; a missing or wrong key
closes the handshake (HTTP 403) before the socket is accepted.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import error_body

PROTECTED_PREFIX = "/v1/"


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys if k)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] not in ("http", "websocket") or not self.keys
                or not scope["path"].startswith(PROTECTED_PREFIX)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            problem = self._problem(scope, query_key=True)
            if problem is None:
                await self.app(scope, receive, send)
            else:
                await send({"type": "websocket.close", "code": 1008, "reason": problem[:120]})
            return
        problem = self._problem(scope)
        if problem is None:
            await self.app(scope, receive, send)
            return
        response = JSONResponse(error_body(401, problem, code="invalid_api_key"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _problem(self, scope: Scope, query_key: bool = False) -> str | None:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None and query_key:
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
            header = b"Bearer " + given[0].encode() if given else None
        if header is None:
            return "Missing API key: send 'Authorization: Bearer <key>'"
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return "Malformed Authorization header: expected 'Bearer <key>'"
        token = token.strip()
        if not any(hmac.compare_digest(token, key) for key in self.keys):
            return "Incorrect API key provided"
        return None
