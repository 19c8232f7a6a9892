"""What one speech request may ask of this engine: the bounds that come from the profile.

The schema (``api.schemas``) fixes the bounds every deployment shares. The fields that size a ring
record, a buffer or a generation are bounded here by what this engine can carry: the longest
first chunk whose PCM fits one record of an API process's ring (``ipc.pcm_ring_bytes``) and whose
codes fit one record of the talker → codec ring (``ipc.codes_ring_bytes``); the frame cap
(``model.max_new_frames``) for ``max_new_tokens`` and ``forced_frames``; ``api.max_input_chars``
for the texts that become prompt tokens. A request past a bound is a 400 naming the limit and the
profile key, and ``/openapi.json`` states the same bounds (``apply_to_schema``).
"""

from __future__ import annotations

from dataclasses import dataclass

from api.errors import bad_request
from api.schemas import SpeechRequest
from ipc.channel import max_payload_bytes


@dataclass(frozen=True)
class RequestLimits:
    """Per-engine bounds on ``SpeechRequest`` fields (see the module docstring)."""

    max_input_chars: int      # input, instructions, ref_text
    max_chunk_frames: int     # initial_codec_chunk_frames
    max_frames: int           # max_new_tokens, forced_frames
    chunk_limit_key: str      # the profile key that binds max_chunk_frames

    @classmethod
    def for_engine(cls, profile, *, channels: int, samples_per_frame: int, n_vq: int) -> RequestLimits:
        """The bounds of ``profile`` for a codec of ``channels`` × ``samples_per_frame`` float32
        samples and ``n_vq`` int64 codes per frame."""
        ipc = profile.ipc
        pcm_frames = max_payload_bytes(ipc.pcm_ring_bytes) // (channels * samples_per_frame * 4)
        code_frames = max_payload_bytes(ipc.codes_ring_bytes) // (n_vq * 8)
        key = "ipc.pcm_ring_bytes" if pcm_frames <= code_frames else "ipc.codes_ring_bytes"
        return cls(max_input_chars=profile.api.max_input_chars,
                   max_chunk_frames=max(1, min(pcm_frames, code_frames)),
                   max_frames=profile.model.max_new_frames, chunk_limit_key=key)

    def bounds(self) -> dict[str, tuple[str, int, str]]:
        """field -> (JSON-schema keyword, bound, profile key behind it)."""
        return {
            "initial_codec_chunk_frames": ("maximum", self.max_chunk_frames, self.chunk_limit_key),
            "forced_frames": ("maximum", self.max_frames, "model.max_new_frames"),
            "max_new_tokens": ("maximum", self.max_frames, "model.max_new_frames"),
            "input": ("maxLength", self.max_input_chars, "api.max_input_chars"),
            "instructions": ("maxLength", self.max_input_chars, "api.max_input_chars"),
            "ref_text": ("maxLength", self.max_input_chars, "api.max_input_chars"),
        }

    def check(self, req: SpeechRequest) -> None:
        """400 for the first field past its bound, naming the limit and its profile key."""
        for name, (keyword, bound, key) in self.bounds().items():
            value = getattr(req, name)
            if value is None:
                continue
            size = len(value) if keyword == "maxLength" else value
            if size > bound:
                unit = " characters" if keyword == "maxLength" else ""
                raise bad_request(f"{name} is {size}{unit}; this server's limit is {bound}{unit} ({key})",
                                  param=name)

    def apply_to_schema(self, document: dict) -> dict:
        """``document`` (the OpenAPI dict) with these bounds written into ``SpeechRequest`` (and
        the input bound into the ElevenLabs body's ``text``)."""
        schemas = document["components"]["schemas"]
        properties = schemas["SpeechRequest"]["properties"]
        for name, (keyword, bound, _) in self.bounds().items():
            for schema in _value_schemas(properties[name]):
                schema[keyword] = min(bound, schema.get(keyword, bound))
        if "TextToSpeechBody" in schemas:
            text = schemas["TextToSpeechBody"]["properties"]["text"]
            text["maxLength"] = min(self.max_input_chars, text.get("maxLength", self.max_input_chars))
        return document


def _value_schemas(prop: dict) -> list[dict]:
    """The non-null schemas of a property (a plain schema, or the members of its anyOf)."""
    members = prop.get("anyOf", [prop])
    return [m for m in members if m.get("type") in ("string", "integer")]
