"""The messages of `WS /v1/audio/speech/stream` (vLLM-Omni's protocol, plus barge-in).

Client → server, JSON text frames, each with a `type` (and an optional `event_id` that an error
about it echoes):
- `session.config`: every field of the speech request (`api.schemas.SpeechRequest`) but `input`,
  plus `split_granularity` (none | sentence | clause, default sentence), `stream_audio` (default
  true: audio frames as they are made; false: one frame per sentence), `speaker` (an alias of
  `voice`) and `word_timestamps` (false only). Sticky: it holds for every utterance until the
  next `session.config`, which replaces it whole (refused while text is buffered or spoken).
- `input.text {text}`: any size, any split (even mid-word).
- `input.done`: speak what is buffered; the session stays open for the next utterance.
- `input.cancel`: barge-in: stop speaking now, drop buffered text; the session stays open.
- `session.close`: speak what is buffered, then close.

Server → client: `audio.start`, binary audio frames, `audio.done`, `session.done`,
`speech.audio.cancelled` and `error` (the OpenAI envelope under `error`, its message also at the
top level as vLLM-Omni clients read it). The builders below are the one place these are shaped;
`OmniEvents` sends them for a session (`api.stream_events`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


from api.errors import ApiError, bad_request
from api.json_body import decode_json
from api.schemas import SpeechRequest, speech_request_from
from api.stream_events import SessionEvents
from api.stream_output import Outbound

Granularity = Literal["none", "sentence", "clause"]
CLIENT_TYPES = ("session.config", "input.text", "input.done", "input.cancel", "session.close")
# the speech request's fields that make no sense on a session, and why
NOT_SESSION_FIELDS = {
    "input": "send the text in input.text messages",
    "stream": "a session always streams; set stream_audio",
    "stream_format": "a session always streams; set stream_audio",
}


@dataclass(frozen=True)
class ClientMessage:
    """One decoded client frame."""

    type: str
    body: dict[str, Any]
    event_id: str | None = None


@dataclass(frozen=True)
class SessionFields:
    """A `session.config` checked against the schema: the speech request and the session's own
    fields (the voice and the output are resolved by the session)."""

    request: SpeechRequest
    split_granularity: Granularity = "sentence"
    stream_audio: bool = True


def decode_message(raw: str) -> ClientMessage:
    """A client text frame → `ClientMessage`; `ApiError` (400) for bad JSON or an unknown type."""
    body = decode_json(raw, what="message")
    if not isinstance(body, dict):
        raise bad_request("a message must be a JSON object with a 'type'")
    event_id = body.pop("event_id", None)
    event_id = event_id if isinstance(event_id, str) and len(event_id) <= 128 else None
    kind = body.pop("type", None)
    if kind not in CLIENT_TYPES:
        raise ApiError(400, f"unknown message type {kind!r}; expected one of {list(CLIENT_TYPES)}",
                       param="type", code="unknown_message_type")
    return ClientMessage(kind, body, event_id)


def session_fields(body: dict[str, Any]) -> SessionFields:
    """The fields of a `session.config` (without `type`); `ApiError` naming a bad one."""
    body = dict(body)
    for key, why in NOT_SESSION_FIELDS.items():
        if key in body:
            raise bad_request(f"{key!r} is not a session field: {why}", param=key)
    split = body.pop("split_granularity", None) or "sentence"
    if split not in ("none", "sentence", "clause"):
        raise bad_request(f"split_granularity {split!r}: expected none, sentence or clause",
                          param="split_granularity")
    stream_audio = body.pop("stream_audio", True)
    if not isinstance(stream_audio, bool):
        raise bad_request("stream_audio must be true or false", param="stream_audio")
    if body.pop("word_timestamps", False):
        raise bad_request("word_timestamps are not supported", param="word_timestamps")
    speaker = body.pop("speaker", None)
    if speaker is not None:
        if body.get("voice") not in (None, speaker):
            raise bad_request("speaker is an alias of voice: send one of them", param="speaker")
        body["voice"] = speaker
    request = speech_request_from({**body, "input": "-"})  # ApiError naming the field
    return SessionFields(request, split, stream_audio)


def input_text(body: dict[str, Any]) -> str:
    text = body.get("text")
    if not isinstance(text, str):
        raise bad_request("input.text needs a string 'text'", param="text")
    return text


# --------------------------------------------------------------------------- server events


def audio_start(utterance: int, sentence: int, text: str, fmt: str, sample_rate: int,
                channels: int) -> dict:
    return {"type": "audio.start", "utterance_index": utterance, "sentence_index": sentence,
            "sentence_text": text, "format": fmt, "sample_rate": sample_rate, "channels": channels}


def audio_done(utterance: int, sentence: int, total_bytes: int, audio_seconds: float,
               finish_reason: str | None, error: bool = False, **report) -> dict:
    """`report`: what the session's fields came to (`SessionSettings.done_fields`:
    ``ignored_fields``, ``untagged_speaker``), each only when there is something to say."""
    return {"type": "audio.done", "utterance_index": utterance, "sentence_index": sentence,
            "total_bytes": total_bytes, "audio_seconds": round(audio_seconds, 4),
            "finish_reason": finish_reason, "error": error, **report}


def session_done(utterance: int, total_sentences: int) -> dict:
    return {"type": "session.done", "utterance_index": utterance, "total_sentences": total_sentences}


def cancelled(utterance: int, sentence: int | None, dropped_chars: int) -> dict:
    return {"type": "speech.audio.cancelled", "utterance_index": utterance,
            "sentence_index": sentence, "dropped_chars": dropped_chars}


def error_event(exc: ApiError, event_id: str | None = None) -> dict:
    event = {"type": "error", "message": exc.message, "error": exc.body()["error"]}
    if event_id is not None:
        event["event_id"] = event_id
    return event


class OmniEvents(SessionEvents):
    """A session's events as this protocol's messages: JSON events, audio as binary frames."""

    def __init__(self, out: Outbound) -> None:
        self.out = out

    async def sentence_start(self, utterance: int, sentence: int, text: str, fmt: str,
                             sample_rate: int, channels: int) -> None:
        await self.out.send_json(audio_start(utterance, sentence, text, fmt, sample_rate, channels))

    async def audio(self, data: bytes) -> None:
        await self.out.send_bytes(data)

    async def sentence_done(self, utterance: int, sentence: int, total_bytes: int,
                            audio_seconds: float, finish_reason: str | None, error: bool,
                            report: dict) -> None:
        await self.out.send_json(audio_done(utterance, sentence, total_bytes, audio_seconds,
                                            finish_reason, error, **report))

    async def utterance_done(self, utterance: int, sentences: int) -> None:
        await self.out.send_json(session_done(utterance, sentences))

    async def error(self, exc: ApiError, event_id: str | None = None) -> None:
        await self.out.send_json(error_event(exc, event_id))

    async def cancelled(self, utterance: int, sentence: int | None, dropped_chars: int) -> None:
        await self.out.send_json(cancelled(utterance, sentence, dropped_chars))
