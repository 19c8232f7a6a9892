"""Errors in the OpenAI envelope: ``{"error": {"message", "type", "param", "code"}}``, and in
ElevenLabs' shape on its routes.

Every failure a client can see leaves the server through :class:`ApiError` (or one of the
Starlette exception handlers below, which wrap framework errors in the same envelope), so clients
written for the OpenAI API parse our errors unchanged. An error that a server limit caused names
that limit's profile field in ``ApiError.limit``; the handler counts it in
``mossvox_limit_hits_total{limit=...}`` (``count_limit`` for errors answered elsewhere: batch
items, WebSocket frames).

Under ``ELEVENLABS_PREFIX`` (the ElevenLabs-compatible text-to-speech routes) the same errors take
ElevenLabs' shape instead: ``{"detail": {"status": code, "message": ...}}``, and for a body that
fails validation (422) ``{"detail": [{"loc": ["body", field], "msg": ..., "type": "value_error"}]}``.
The handlers and the middlewares that answer errors pick the shape by path (``error_body_for``).
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from api.streaming import StreamCut

log = logging.getLogger("mossvox.api")

# HTTP status -> OpenAI error ``type``.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A client-visible error; rendered as the OpenAI envelope with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        limit: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.limit = limit  # the profile field of the server limit that caused it, if one did

    def body(self) -> dict:
        """The envelope as a JSON-ready dict."""
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


ELEVENLABS_PREFIX = "/v1/text-to-speech/"


def elevenlabs_error_body(status: int, message: str, *, param: str | None = None,
                          code: str | None = None) -> dict:
    """An error as ElevenLabs answers it: ``detail`` with a status word and the message, or for a
    422 (a body that fails validation) the list of failing fields."""
    if status == 422:
        loc = ["body", *param.split(".")] if param else ["body"]
        return {"detail": [{"loc": loc, "msg": message, "type": "value_error"}]}
    word = code or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"detail": {"status": word, "message": message}}


def error_body_for(path: str, status: int, message: str, *, param: str | None = None,
                   code: str | None = None) -> dict:
    """The error body a client of ``path`` reads: ElevenLabs' shape under its routes, the
    OpenAI envelope elsewhere."""
    shape = elevenlabs_error_body if path.startswith(ELEVENLABS_PREFIX) else error_body
    return shape(status, message, param=param, code=code)


def bad_request(message: str, param: str | None = None, code: str | None = None,
                limit: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code, limit=limit)


def count_limit(state, exc: BaseException) -> None:
    """Count ``exc`` in the limit metric when a server limit caused it (``ApiError.limit``);
    ``state`` is the process's ``ApiState`` (or None before it exists)."""
    limit = getattr(exc, "limit", None)
    if limit and state is not None:
        state.metrics.limit_hit(limit)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    count_limit(getattr(request.state, "api", None), exc)
    if exc.status >= 500:
        log.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
    body = error_body_for(request.url.path, exc.status, exc.message, param=exc.param, code=exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        message = f"No route {request.method} {request.url.path}"
    return JSONResponse(error_body_for(request.url.path, exc.status_code, message),
                        status_code=exc.status_code, headers=dict(exc.headers or {}))


async def client_gone_handler(request: Request, exc: Exception) -> Response:
    """The client left mid-request (mid-body, say): nobody to answer, nothing to log."""
    return Response(status_code=499)


async def unhandled_error_handler(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, StreamCut):  # a cut on purpose, logged by the route that made it
        log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(error_body_for(request.url.path, 500, f"Internal server error: {type(exc).__name__}"),
                        status_code=500)


EXCEPTION_HANDLERS = {
    ApiError: api_error_handler,
    HTTPException: http_error_handler,
    ClientDisconnect: client_gone_handler,
    Exception: unhandled_error_handler,
}
