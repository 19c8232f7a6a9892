"""JSON from clients, read one way by every route and WebSocket message.

Any client text that is parsed as JSON goes through :func:`decode_json` (or
:func:`decode_typed` with a typed decoder): malformed JSON, a lone UTF-16 surrogate escape
(``"\\ud800"``, which no Unicode text holds), or nesting deeper than the decoder's recursion
limit is a 400 (or the status the caller names) in the OpenAI envelope, never a 500, a dropped
socket or a traceback.

HTTP routes that read a JSON body call :func:`read_json_body`: the body must be sent as
``Content-Type: application/json`` (or a ``+json`` type), else 415, so that a page on another
origin cannot reach them with a form or a ``text/plain`` fetch, which browsers send without
asking first (a body without any ``Content-Type`` is read as JSON: browsers always name one).
Note for curl users: ``curl -d`` sends ``application/x-www-form-urlencoded``; add
``-H 'Content-Type: application/json'`` (or use ``--json``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request

from api.errors import ApiError

JSON_HINT = "send it as Content-Type: application/json (curl: --json, or -H 'Content-Type: application/json')"


def decode_json(raw: bytes | str, *, what: str = "Request body", status: int = 400,
                code: str | None = None) -> Any:
    """``raw`` as plain JSON values (dict, list, str, ...); ``ApiError(status)`` otherwise."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(status, f"{what} is not valid JSON: {exc}", code=code) from None
    except RecursionError:
        raise ApiError(status, f"{what} nests too deeply", code=code) from None


def decode_typed(decoder: msgspec.json.Decoder, raw: bytes | str, *, what: str = "Request body",
                 status: int = 400, code: str | None = None) -> Any:
    """``raw`` decoded by a typed ``decoder``; malformed or too deep JSON is ``ApiError(status)``,
    a ``msgspec.ValidationError`` is left to the caller (it names the field)."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError as exc:
        raise ApiError(status, f"{what} is not valid JSON: {exc}", code=code) from None
    except RecursionError:
        raise ApiError(status, f"{what} nests too deeply", code=code) from None


def is_json_content_type(value: str | None) -> bool:
    """``application/json``, ``application/<x>+json`` (parameters allowed), or none at all."""
    if value is None or not value.strip():
        return True
    kind = value.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def require_json(request: Request) -> None:
    """415 unless the request's body is declared as JSON (see the module docstring)."""
    content_type = request.headers.get("content-type")
    if not is_json_content_type(content_type):
        raise ApiError(415, f"This endpoint reads a JSON body, not {content_type.split(';')[0].strip()}: "
                            f"{JSON_HINT}", code="unsupported_media_type")


async def read_json_body(request: Request) -> bytes:
    """The body of a request that must be JSON (415 otherwise), not yet decoded."""
    require_json(request)
    return await request.body()
