"""Request fields the served model does not use: accepted and reported, or refused when the profile
says so (``api.strict_fields``).

One client should work against every model family. So a field the served family has no use for
(the variant's ``used_fields``; ``task_type``, which no MOSS model reads) is ignored rather than
refused, and the response names it. An ignored field is not read at all: an ignored
``ref_audio`` is neither fetched nor decoded, an ignored ``voice`` is not looked up. Fields that
are wrong rather than unused (a malformed reference, too many references, a speaker tag out of
range) are the adapter's to refuse, as before.

``screen_fields`` runs once per request, before any reference is loaded, and returns the request
without its ignored fields and a ``FieldReport``; every kind of response reports from that one
record: ``headers()`` for HTTP responses, ``event_fields()`` for the SSE ``speech.audio.done``
event, a batch item, a WebSocket ``audio.done`` (`api.stream_settings`), and any other
per-request completion record.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from api.errors import bad_request
from api.schemas import SpeechRequest
from api.speech_job import OPENAI_VOICES
from speech.job import OptionalField
from stages.variant import Variant

IGNORED_HEADER = "X-Ignored-Fields"
SPEAKER_HEADER = "X-Untagged-Speaker"

# HTTP field -> the optional job field it feeds (None: no model uses it), in reporting order
HTTP_FIELDS: dict[str, OptionalField | None] = {
    "ref_audio": "reference",
    "voice": "reference",        # only a registered voice's name; the built-in names are no reference
    "ref_text": "ref_text",
    "instructions": "instructions",
    "language": "language",
    "task_type": None,           # accepted from vLLM-Omni clients; no MOSS model reads it
}


@dataclass(frozen=True)
class FieldReport:
    """What the served model made of a request's fields: the ones it ignored (HTTP names, in
    `HTTP_FIELDS` order) and, for multi-speaker models, the speaker that untagged text went to."""

    ignored: tuple[str, ...] = ()
    untagged_speaker: str | None = None

    def headers(self) -> dict[str, str]:
        """``X-Ignored-Fields: ref_text, instructions`` and ``X-Untagged-Speaker: [S1]``, each
        only when there is something to say."""
        headers = {}
        if self.ignored:
            headers[IGNORED_HEADER] = ", ".join(self.ignored)
        if self.untagged_speaker:
            headers[SPEAKER_HEADER] = self.untagged_speaker
        return headers

    def event_fields(self) -> dict:
        """The same facts for a completion record: ``ignored_fields`` (a list) and
        ``untagged_speaker``, each only when there is something to say."""
        fields: dict = {}
        if self.ignored:
            fields["ignored_fields"] = list(self.ignored)
        if self.untagged_speaker:
            fields["untagged_speaker"] = self.untagged_speaker
        return fields


def given_fields(req: SpeechRequest) -> tuple[str, ...]:
    """The fields of `HTTP_FIELDS` that ``req`` sets (blank text and built-in voice names count as
    unset), in `HTTP_FIELDS` order."""
    given = []
    for name in HTTP_FIELDS:
        value = getattr(req, name)
        if name == "voice":
            value = getattr(value, "id", value)
            if isinstance(value, str) and value.strip().lower() in OPENAI_VOICES:
                continue
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        given.append(name)
    return tuple(given)


def used_http_fields(variant: Variant) -> tuple[str, ...]:
    """The optional HTTP fields ``variant`` uses (what ``GET /v1/models`` lists)."""
    return tuple(name for name, job_field in HTTP_FIELDS.items() if job_field in variant.used_fields)


def screen_fields(req: SpeechRequest, variant: Variant, *, strict: bool) -> tuple[SpeechRequest, FieldReport]:
    """``req`` without the fields ``variant`` does not use, and the report of them; with
    ``strict``, a 400 naming those fields instead."""
    ignored = tuple(name for name in given_fields(req)
                    if HTTP_FIELDS[name] is None or HTTP_FIELDS[name] not in variant.used_fields)
    if ignored and strict:
        raise bad_request(f"{variant.name} does not use {', '.join(ignored)}, and this server refuses "
                          f"fields its model does not use (api.strict_fields); leave them out",
                          param=ignored[0], code="unused_field")
    if ignored:
        req = msgspec.structs.replace(req, **{name: None for name in ignored})
    return req, FieldReport(ignored, variant.default_speaker(req.input))
