"""Server-sent events of a streaming speech response (vLLM-Omni compatible).

``speech.audio.delta`` carries base64 bytes of the response file (one continuous container
across events), ``speech.audio.done`` the finish reason and the usage (including seconds of
audio) and, when there is any, the request fields the model ignored and the speaker untagged
text went to, and
``speech.audio.error`` replaces ``done`` when the request fails after it started. Each event is
an ``event:`` line, one JSON ``data:`` line and a blank line; there is no ``[DONE]`` sentinel.
"""

from __future__ import annotations

import base64

import msgspec

CONTENT_TYPE = "text/event-stream"
_encode = msgspec.json.Encoder().encode


def event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"


def delta(audio: bytes, response_format: str, *, sample_rate: int | None = None,
          channels: int | None = None) -> bytes:
    """One audio delta; the first of a stream also names the sample rate and channels."""
    data = {"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode(),
            "response_format": response_format}
    if sample_rate is not None:
        data["sample_rate"] = sample_rate
        data["channels"] = channels
    return event("speech.audio.delta", data)


def done(usage: dict, *, finish_reason: str, **report) -> bytes:
    """The end of a stream: why generation stopped (``stop`` or ``length``), the usage, and what
    the request's fields came to (`api.fields.FieldReport.event_fields`: ``ignored_fields``,
    ``untagged_speaker``)."""
    return event("speech.audio.done", {"type": "speech.audio.done", "finish_reason": finish_reason,
                                       "usage": usage, **report})


def error(message: str, *, partial_audio: bool, code: int = 500, kind: str = "server_error") -> bytes:
    data = {"type": "speech.audio.error",
            "error": {"message": message, "type": kind, "param": None, "code": code}}
    if partial_audio:
        data.update(partial_audio=True, action="discard")
    return event("speech.audio.error", data)
