"""Request-body size limit (``api.max_body_bytes``): 413 in the OpenAI envelope.

A declared ``Content-Length`` over the limit is refused before reading; a chunked body is counted
as it arrives and refused once it passes the limit.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ApiError, error_body_for


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            body = error_body_for(scope["path"], 413, self._message(int(length)))
            await JSONResponse(body, status_code=413)(scope, receive, send)
            return
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise ApiError(413, self._message(seen, at_least=True))
            return message

        await self.app(scope, counted_receive, send)

    def _message(self, size: int, at_least: bool = False) -> str:
        qualifier = "at least " if at_least else ""
        return f"Request body is {qualifier}{size} bytes; the limit is {self.max_bytes} (api.max_body_bytes)"
