"""What a speech session tells its client, whatever the wire protocol: `SessionEvents`.

A session's speaking pipelines (`api.stream_pipeline`, `api.stream_incremental`) and the session
itself (`api.stream_session`) report through this one interface; each WebSocket protocol
implements it over its own messages: `api.stream_protocol.OmniEvents` for
`/v1/audio/speech/stream` (JSON events and binary audio frames), `api.elevenlabs_protocol` for the
ElevenLabs-compatible sockets (base64 audio in JSON, `isFinal`). A protocol without a message for
an event (ElevenLabs has no sentence boundaries) does nothing for it. Every method sends through
the session's `api.stream_output.Outbound`, so each raises `PeerGone` once the client is gone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from api.errors import ApiError


class SessionEvents(ABC):
    """The outgoing side of one speech session (or one context of a multi-context socket)."""

    @abstractmethod
    async def sentence_start(self, utterance: int, sentence: int, text: str, fmt: str,
                             sample_rate: int, channels: int) -> None:
        """A sentence's audio begins: `text`, and the audio's format and layout."""

    @abstractmethod
    async def audio(self, data: bytes) -> None:
        """The next encoded bytes of the sentence being spoken."""

    @abstractmethod
    async def sentence_done(self, utterance: int, sentence: int, total_bytes: int,
                            audio_seconds: float, finish_reason: str | None, error: bool,
                            report: dict) -> None:
        """The sentence's audio is complete; `report`: what the session's fields came to
        (`SessionSettings.done_fields`)."""

    @abstractmethod
    async def utterance_done(self, utterance: int, sentences: int) -> None:
        """Every sentence of an utterance (the text up to a flush) has been spoken."""

    @abstractmethod
    async def error(self, exc: ApiError, event_id: str | None = None) -> None:
        """A message was refused, or a sentence failed in the engine; the session goes on."""

    @abstractmethod
    async def cancelled(self, utterance: int, sentence: int | None, dropped_chars: int) -> None:
        """Barge-in: what was speaking stopped, `dropped_chars` of buffered text went unspoken."""
