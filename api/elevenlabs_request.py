"""ElevenLabs text-to-speech requests as this server's own speech requests.

ElevenLabs' API (``/v1/text-to-speech/{voice_id}`` over HTTP, and its two WebSockets) names things
its own way; this module is the one place they are mapped, for the HTTP routes
(`api.routes.text_to_speech`) and the sockets (`api.elevenlabs_protocol`) alike:
- ``voice_id`` → ``voice``: a registered voice or a built-in name (``default``, the OpenAI names);
- ``output_format`` (``codec_rate[_kbps]``: ``pcm_16000``, ``mp3_44100_128``, ``ulaw_8000``,
  ``opus_48000_64``, ...) → the output plan: always mono, at that rate and bit rate;
- ``voice_settings.speed`` → ``speed``; ``seed`` → ``seed``; ``language_code`` → ``language``;
- ``model_id`` → ``model`` when it names the served model; another (an ElevenLabs model) is
  ignored and reported.
Every other field ElevenLabs defines (stability, similarity boost, style, speaker boost,
pronunciation dictionaries, previous/next text, text normalization, latency optimization, ...)
is accepted, and when set to anything but its default, reported as ignored (``X-Ignored-Fields``,
or ``ignored_fields`` on a socket's final message), like the fields a model does not use; under
``api.strict_fields`` it is refused. Fields this module does not know are reported the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from api.audio_encoding import OUTPUT_RATES
from api.errors import ApiError
from api.json_body import decode_json
from api.schemas import SpeechRequest, TextToSpeechBody
from api.speech_job import OutputPlan

HTTP_DEFAULT_FORMAT = "mp3_44100_128"
SOCKET_DEFAULT_FORMAT = "mp3_44100"
_FORMAT = re.compile(r"(mp3|pcm|ulaw|alaw|opus)_(\d+)(?:_(\d+))?")
_DEFAULT_KBPS = {"mp3": 128, "opus": 64}
_KBPS_RANGE = {"mp3": (8, 320), "opus": (6, 510)}
_MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
# our speech request's field -> the ElevenLabs name a client of these routes knows it by
ELEVENLABS_NAMES = {"input": "text", "voice": "voice_id", "speed": "voice_settings.speed",
                    "language": "language_code", "sample_rate": "output_format", "seed": "seed",
                    "model": "model_id"}
VOICE_SETTINGS = ("stability", "similarity_boost", "style", "use_speaker_boost", "speed")


@dataclass(frozen=True)
class OutputFormat:
    """An ``output_format``: codec (this server's response format), rate, bit rate."""

    name: str
    response_format: str   # pcm | mp3 | ulaw | alaw | opus
    sample_rate: int
    bit_rate: int | None   # bits per second (mp3, opus)

    def plan(self, *, mode: str, speed: float) -> OutputPlan:
        """The output plan: mono at this rate, delivered as ``mode`` (file, audio)."""
        return OutputPlan(response_format=self.response_format, mode=mode, speed=speed,
                          sample_rate=self.sample_rate, channels=1, bit_rate=self.bit_rate)


def output_format(value: str | None, default: str) -> OutputFormat:
    """``output_format`` (``default`` when not given) → `OutputFormat`; a 400 naming the ones
    accepted otherwise."""
    name = value or default
    match = _FORMAT.fullmatch(name)
    if match is None:
        raise _bad_format(name, "expected codec_rate or codec_rate_kbps, such as pcm_16000 or "
                                "mp3_44100_128")
    codec, rate, kbps = match.group(1), int(match.group(2)), match.group(3)
    rates = {"pcm": OUTPUT_RATES, "mp3": _MP3_RATES, "opus": _OPUS_RATES}.get(codec, (8000,))
    if rate not in rates:
        raise _bad_format(name, f"{codec} comes at {', '.join(map(str, rates))} Hz")
    if codec not in _DEFAULT_KBPS:
        if kbps is not None:
            raise _bad_format(name, f"{codec} has no bit rate")
        return OutputFormat(name, codec, rate, None)
    low, high = _KBPS_RANGE[codec]
    rate_kbps = _DEFAULT_KBPS[codec] if kbps is None else int(kbps)
    if not low <= rate_kbps <= high:
        raise _bad_format(name, f"{codec} bit rates are {low} to {high} kbps")
    return OutputFormat(name, codec, rate, rate_kbps * 1000)


def _bad_format(name: str, why: str) -> ApiError:
    return ApiError(400, f"output_format {name!r} is not supported: {why}", param="output_format",
                    code="invalid_output_format")


_USED = frozenset({"text", "model_id", "language_code", "voice_settings", "seed"})
# a field at one of these values asks for nothing: not reported when ignored
_DEFAULTS: dict[str, tuple] = {"apply_text_normalization": ("auto",), "enable_logging": (True, "true"),
                               "use_pvc_as_ivc": (False,), "apply_language_text_normalization": (False,),
                               "auto_mode": (False, "false"), "enable_ssml_parsing": (False, "false"),
                               "sync_alignment": (False, "false"), "try_trigger_generation": (False,),
                               "style": (0, 0.0), "use_speaker_boost": (True,)}


def given(name: str, value: Any) -> bool:
    """Whether ``value`` of field ``name`` asks for something (not unset, empty or the default)."""
    if value is None or value == "" or value == [] or value == {}:
        return False
    return value not in _DEFAULTS.get(name, ())


def ignored_settings(voice_settings: dict[str, Any] | None) -> tuple[str, ...]:
    """The ``voice_settings`` that nothing here uses, as ``voice_settings.<name>``."""
    return tuple(f"voice_settings.{name}" for name, value in (voice_settings or {}).items()
                 if name != "speed" and given(name, value))


def voice_speed(voice_settings: dict[str, Any] | None) -> float:
    """``voice_settings.speed`` (1.0 when not given); a 400 when it is not a number in 0.25-4."""
    speed = (voice_settings or {}).get("speed")
    if speed is None:
        return 1.0
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
        raise ApiError(400, f"voice_settings.speed {speed!r}: expected a number from 0.25 to 4",
                       param="voice_settings.speed")
    return float(speed)


def decode_body(raw: bytes) -> tuple[TextToSpeechBody, tuple[str, ...]]:
    """A JSON body → the body and the names of its fields that are set but unused (unknown
    ones included); a 422 naming the field for a body that fails validation."""
    fields = decode_json(raw, status=422)
    if not isinstance(fields, dict):
        raise ApiError(422, "Request body must be a JSON object")
    try:
        body = msgspec.convert(fields, TextToSpeechBody)
    except msgspec.ValidationError as exc:
        match = re.search(r"at `\$\.?([^`]*)`", str(exc))
        raise ApiError(422, str(exc), param=(match.group(1) if match else None) or None) from None
    unused = tuple(name for name, value in fields.items() if name not in _USED and given(name, value))
    return body, unused + ignored_settings(body.voice_settings)


def speech_request(text: str, voice_id: str, *, fmt: OutputFormat, model_id: str | None,
                   language_code: str | None, speed: float, seed: int | None,
                   model_names: tuple[str, ...]) -> tuple[SpeechRequest, tuple[str, ...]]:
    """This server's speech request for an ElevenLabs one, and the ElevenLabs fields among these
    that it ignores (``model_id`` naming a model this server does not serve)."""
    ours = model_id if model_id in model_names else None
    request = SpeechRequest(
        input=text, voice=voice_id, model=ours, language=language_code, seed=seed, speed=speed,
        # the output plan (`OutputFormat.plan`) decides the file; this only keeps the rate checked
        response_format=fmt.response_format if fmt.response_format in ("pcm", "mp3", "opus") else "pcm",
        sample_rate=fmt.sample_rate, channels=1)
    return request, (("model_id",) if model_id and ours is None else ())


def elevenlabs_names(fields: tuple[str, ...]) -> tuple[str, ...]:
    """Our speech request's field names (as `api.fields` reports them) in ElevenLabs' terms."""
    return tuple(ELEVENLABS_NAMES.get(name, name) for name in fields)


def in_elevenlabs_terms(exc: ApiError) -> ApiError:
    """``exc`` naming the ElevenLabs field rather than ours."""
    if exc.param in ELEVENLABS_NAMES:
        exc.param = ELEVENLABS_NAMES[exc.param]
    return exc


def refuse_unused(unused: tuple[str, ...], *, strict: bool) -> None:
    """Under ``api.strict_fields``, a 400 naming the fields that nothing here uses."""
    if unused and strict:
        raise ApiError(400, f"this server does not use {', '.join(unused)}, and refuses fields it "
                            f"does not use (api.strict_fields); leave them out", param=unused[0],
                       code="unused_field")
