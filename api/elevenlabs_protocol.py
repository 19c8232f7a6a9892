"""The messages of ElevenLabs' text-to-speech WebSockets, as their API reference defines them.

Two sockets, one message vocabulary (`api.elevenlabs_session` acts on them):
- ``/v1/text-to-speech/{voice_id}/stream-input``: one stream of text. The first message opens it
  (``text: " "``, optional ``voice_settings``, ``generation_config``, and the key as ``xi-api-key``
  or ``authorization`` when the handshake had none); then ``{"text": "..."}`` pieces, any split,
  ``flush: true`` to speak what is buffered now, and ``{"text": ""}`` to end: the rest is spoken,
  then ``{"isFinal": true}``, then the socket closes (1000).
- ``/v1/text-to-speech/{voice_id}/multi-stream-input``: independent contexts on one socket, each
  named by ``context_id``: its first message opens it (with its own ``voice_settings``), then
  text and ``flush`` as above; ``{"context_id", "close_context": true}`` ends it and
  ``{"close_socket": true}`` ends them all and the socket. ``{"text": ""}`` only keeps it alive.
Server → client: ``{"audio": <base64>}`` pieces of the file in the handshake's ``output_format``
(with ``contextId`` on the multi-context socket), ``{"isFinal": true}`` once a stream or context
has spoken its last (with ``ignored_fields``: the fields that nothing here used, when there are
any), and errors as ``{"message", "error": <code>, "code": <status>}`` (``contextId`` where one
context is concerned). Character alignment is not supported: audio messages carry none.

The handshake's query (`SocketQuery`): ``output_format`` (default ``mp3_44100``), ``model_id``,
``language_code``, ``seed``, ``inactivity_timeout`` (seconds, default 20, at most 180) are used,
and ``auto_mode=true`` (a client that sends whole phrases) makes the end of each text message a
segment boundary; without it, text is cut into sentences wherever its pieces end;
``enable_logging``, ``enable_ssml_parsing``, ``sync_alignment``, ``apply_text_normalization`` and
the rest are accepted and reported when set to anything but their defaults.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from api.elevenlabs_request import (SOCKET_DEFAULT_FORMAT, OutputFormat, given, ignored_settings,
                                    output_format, voice_speed)
from api.errors import ApiError, bad_request
from api.json_body import decode_json
from api.stream_events import SessionEvents
from api.stream_output import Outbound

DEFAULT_INACTIVITY_S, MAX_INACTIVITY_S = 20, 180
_QUERY_USED = frozenset({"output_format", "model_id", "language_code", "seed", "inactivity_timeout",
                         "auto_mode", "authorization", "api_key"})
_MESSAGE_KEYS = frozenset({"text", "voice_settings", "generation_config", "flush", "xi-api-key",
                           "xi_api_key", "authorization", "context_id", "contextId", "close_context",
                           "close_socket", "try_trigger_generation", "pronunciation_dictionary_locators"})


@dataclass(frozen=True)
class SocketQuery:
    """A socket's handshake query, checked."""

    fmt: OutputFormat
    model_id: str | None
    language_code: str | None
    seed: int | None
    inactivity_s: float
    auto_mode: bool          # each message is a complete phrase
    unused: tuple[str, ...]  # set, and nothing here uses them


def socket_query(query) -> SocketQuery:
    """The handshake's query parameters (a mapping) → `SocketQuery`; a 400 naming a bad one."""
    fmt = output_format(query.get("output_format"), SOCKET_DEFAULT_FORMAT)
    seed = _integer(query, "seed", 0, 4294967295)
    inactivity = _integer(query, "inactivity_timeout", 1, MAX_INACTIVITY_S)
    unused = tuple(name for name in query.keys() if name not in _QUERY_USED and given(name, query[name]))
    return SocketQuery(fmt=fmt, model_id=query.get("model_id") or None,
                       language_code=query.get("language_code") or None, seed=seed,
                       inactivity_s=float(inactivity or DEFAULT_INACTIVITY_S),
                       auto_mode=query.get("auto_mode", "false").lower() == "true", unused=unused)


def _integer(query, name: str, low: int, high: int) -> int | None:
    value = query.get(name)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or not low <= number <= high:
        raise bad_request(f"{name} {value!r}: expected an integer from {low} to {high}", param=name)
    return number


@dataclass(frozen=True)
class ClientFrame:
    """One client message of either socket."""

    text: str | None          # None: the message carries no text field
    flush: bool
    context_id: str | None
    close_context: bool
    close_socket: bool
    speed: float | None       # voice_settings.speed, when given
    key: str | None           # the API key, when the message carries one
    unused: tuple[str, ...]   # fields set that nothing here uses


def decode_frame(raw: str) -> ClientFrame:
    """A client text message → `ClientFrame`; a 400 for one that is not a JSON object of the
    protocol's fields with the types they take."""
    body = decode_json(raw, what="message", code="invalid_input_message")
    if not isinstance(body, dict):
        raise bad_request("a message must be a JSON object", code="invalid_input_message")
    text = _typed(body, "text", str)
    context_id = _typed(body, "context_id", str)
    if context_id is None:
        context_id = _typed(body, "contextId", str)
    settings = _typed(body, "voice_settings", dict)
    key = _typed(body, "xi-api-key", str) or _typed(body, "xi_api_key", str)
    authorization = _typed(body, "authorization", str)
    if key is None and authorization:
        key = authorization.removeprefix("Bearer ").removeprefix("bearer ")
    config = _typed(body, "generation_config", dict) or {}
    unused = tuple(name for name, value in body.items() if name not in _MESSAGE_KEYS and given(name, value))
    unused += tuple(f"generation_config.{name}" for name, value in config.items() if given(name, value))
    unused += tuple(name for name in ("try_trigger_generation", "pronunciation_dictionary_locators")
                    if given(name, body.get(name)))
    speed = voice_speed(settings) if settings and settings.get("speed") is not None else None
    return ClientFrame(text=text, flush=bool(_typed(body, "flush", bool)), context_id=context_id,
                       close_context=bool(_typed(body, "close_context", bool)),
                       close_socket=bool(_typed(body, "close_socket", bool)), speed=speed, key=key,
                       unused=unused + ignored_settings(settings))


def _typed(body: dict, name: str, kind: type):
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise bad_request(f"{name} must be {'an object' if kind is dict else kind.__name__}", param=name,
                          code="invalid_input_message")
    return value


# --------------------------------------------------------------------------- server messages


def audio_message(data: bytes, context_id: str | None) -> dict:
    message: dict = {"audio": base64.b64encode(data).decode()}
    if context_id is not None:
        message["contextId"] = context_id
    return message


def final_message(context_id: str | None, report: dict) -> dict:
    """The last message of a stream or context; `report`: `FieldReport.event_fields()`."""
    message: dict = {"isFinal": True}
    if context_id is not None:
        message["contextId"] = context_id
    return {**message, **report}


def error_message(exc: ApiError, context_id: str | None = None) -> dict:
    message = {"message": exc.message, "error": exc.code or _WORDS.get(exc.status, "error"),
               "code": exc.status}
    if context_id is not None:
        message["contextId"] = context_id
    return message


_WORDS = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 429: "overloaded",
          500: "internal_error", 503: "service_unavailable"}


class ElevenLabsEvents(SessionEvents):
    """One stream's (or one context's) events as these messages: audio pieces in base64, errors;
    sentence and utterance boundaries have no message here."""

    def __init__(self, out: Outbound, context_id: str | None) -> None:
        self.out, self.context_id = out, context_id

    async def sentence_start(self, utterance: int, sentence: int, text: str, fmt: str,
                             sample_rate: int, channels: int) -> None:
        pass

    async def audio(self, data: bytes) -> None:
        await self.out.send_json(audio_message(data, self.context_id))

    async def sentence_done(self, utterance: int, sentence: int, total_bytes: int,
                            audio_seconds: float, finish_reason: str | None, error: bool,
                            report: dict) -> None:
        pass

    async def utterance_done(self, utterance: int, sentences: int) -> None:
        pass

    async def error(self, exc: ApiError, event_id: str | None = None) -> None:
        await self.out.send_json(error_message(exc, self.context_id))

    async def cancelled(self, utterance: int, sentence: int | None, dropped_chars: int) -> None:
        pass

    async def final(self, report: dict) -> None:
        await self.out.send_json(final_message(self.context_id, report))
