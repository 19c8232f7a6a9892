"""From a validated ``SpeechRequest`` to the engine-level ``SpeechJob`` and output settings.

Checks what the schema cannot (model name, input length, sample rate), merges the sampling
fields (top level over ``extra_params``), and resolves the voice: an inline ``ref_audio`` goes
through the reference loader and the shared code cache; a registered voice brings its stored
codes (and transcript); ``default`` or an OpenAI built-in name means the model's own voice.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from api.audio_encoding import OUTPUT_RATES
from api.errors import ApiError, bad_request
from api.request_limits import RequestLimits
from api.schemas import SpeechRequest, VoiceObject
from engine.client import EngineFailed

OPENAI_VOICES = frozenset({"default", "alloy", "ash", "ballad", "coral", "echo", "fable", "onyx",
                           "nova", "sage", "shimmer", "verse", "marin", "cedar"})
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


OPENAI_PCM_LAYOUT = (24000, 1)  # OpenAI's pcm: 24 kHz mono s16le


@dataclass(frozen=True)
class OutputPlan:
    """How the response is delivered, and the audio layout of the file."""

    response_format: str
    mode: str  # "file" (whole file), "audio" (raw stream) or "sse"
    speed: float
    sample_rate: int  # output rate
    channels: int  # output channels
    bit_rate: int | None = None  # bits per second of a compressed format; None: the format's own


def output_plan(req: SpeechRequest, *, native_rate: int, native_channels: int,
                pcm_layout: str = "openai") -> OutputPlan:
    """Delivery and layout. Every format streams unless the request says ``stream: false``,
    except flac, whose header can state its length only when the whole file is sent at once (a
    streamed flac must be asked for). ``pcm`` takes OpenAI's layout unless the request or the
    profile (``api.pcm_layout``) asks for the native one."""
    if req.stream_format is not None:
        mode = req.stream_format
    elif req.stream is not None:
        mode = "sse" if req.stream else "file"
    else:
        mode = "file" if req.response_format == "flac" else "audio"
    rate, channels = req.sample_rate, req.channels
    if req.response_format == "pcm" and pcm_layout == "openai":
        rate = rate or OPENAI_PCM_LAYOUT[0]
        channels = channels or OPENAI_PCM_LAYOUT[1]
    return OutputPlan(response_format=req.response_format, mode=mode, speed=req.speed,
                      sample_rate=rate or native_rate, channels=channels or native_channels)


def model_not_found(name: str, model_names) -> ApiError:
    """404 for a model name this server does not serve, listing the ones it does."""
    return ApiError(404, f"The model '{name}' does not exist; this server serves {', '.join(model_names)}",
                    param="model", code="model_not_found")


def check_request(req: SpeechRequest, *, model_names, limits: RequestLimits, sample_rate: int) -> None:
    """What the static schema cannot check: the model name (one of ``model_names``), an empty
    input, ``stream: false`` beside a ``stream_format`` (a whole file and a stream at once), this
    engine's bounds (``RequestLimits``) and the output rate."""
    if req.model is not None and req.model not in model_names:
        raise model_not_found(req.model, model_names)
    if not req.input.strip():
        raise bad_request("Input text cannot be empty", param="input")
    if req.stream is False and req.stream_format is not None:
        raise bad_request(f"'stream': false asks for the whole file at once, but 'stream_format': "
                          f"'{req.stream_format}' asks for a stream: send one of them",
                          param="stream_format", code="conflicting_fields")
    limits.check(req)
    if req.sample_rate is not None and req.sample_rate not in (sample_rate, *OUTPUT_RATES):
        raise bad_request(f"sample_rate {req.sample_rate} is not supported: use the model's "
                          f"{sample_rate} Hz or one of {list(OUTPUT_RATES)}", param="sample_rate")


def sampling_overrides(req: SpeechRequest) -> dict:
    """The request's sampling fields for the variant's adapter (only those that were given)."""
    merged: dict = {}
    if req.extra_params is not None:
        merged.update({k: getattr(req.extra_params, k) for k in SAMPLING_FIELDS})
    for key in SAMPLING_FIELDS:
        value = getattr(req, key)
        if value is not None:
            merged[key] = value
    if req.seed is not None:
        merged["seed"] = req.seed
    if req.max_new_tokens is not None:
        merged["max_new_frames"] = req.max_new_tokens
    return {k: v for k, v in merged.items() if v is not None}


@dataclass(frozen=True)
class ResolvedVoice:
    codes: np.ndarray | None  # [T, n_vq] int64
    ref_text: str | None
    source: str  # "none", "ref_audio" or "voice:<name>"
    cache_hit: bool | None = None  # with several clips: True only when every one was cached
    extra_codes: tuple[np.ndarray, ...] = ()  # the 2nd, 3rd, ... ref_audio clip (TTSD speakers)


async def resolve_voice(req: SpeechRequest, state, tracker=None) -> ResolvedVoice:
    """Reference codes for the request, from ``ref_audio`` or a registered voice; ``tracker``
    (the request's, when timed) gets ``loaded_at`` once its clips are fetched and decoded."""
    ref_text = req.ref_text if req.ref_text and req.ref_text.strip() else None
    if req.ref_audio is not None:
        clips = [req.ref_audio] if isinstance(req.ref_audio, str) else req.ref_audio
        loaded = [await state.references.load(clip) for clip in clips]
        if tracker is not None:
            tracker.loaded_at = time.monotonic()
        found = [await reference_codes(state, clip) for clip in loaded]
        return ResolvedVoice(codes=found[0][0], ref_text=ref_text, source="ref_audio",
                             cache_hit=all(hit for _, hit in found),
                             extra_codes=tuple(codes for codes, _ in found[1:]))
    name = req.voice.id if isinstance(req.voice, VoiceObject) else req.voice
    if name is None or not name.strip():
        return _own_voice(ref_text)
    voice = await asyncio.to_thread(state.voices.get, name)
    if voice is None:
        if name.lower() in OPENAI_VOICES:
            return _own_voice(ref_text)
        raise ApiError(404, f"Voice '{name}' is not registered; see GET /v1/audio/voices, or use "
                            f"'default' for the model's own voice", param="voice", code="voice_not_found")
    if voice.namespace != state.ref_cache.namespace:
        raise bad_request(f"Voice '{name}' was registered for another model or codec setup; "
                          f"upload it again", param="voice")
    return ResolvedVoice(codes=voice.codes, ref_text=ref_text or voice.info.ref_text, source=f"voice:{name}")


async def reference_codes(state, prepared) -> tuple[np.ndarray, bool]:
    """Codes of a prepared clip through the shared cache (misses go to the codec worker)."""
    try:
        codes, hit = await state.ref_cache.get_or_encode(prepared.digest, prepared.prepare)
    except EngineFailed as exc:  # 503 while no replica serves (failed, or being restarted)
        raise ApiError(503 if not state.client.ready() else 500,
                       f"Reference encoding failed: {exc}", param="ref_audio",
                       headers={"Retry-After": "1"}) from None
    except (ValueError, RuntimeError) as exc:
        raise ApiError(500, f"Reference encoding failed: {exc}", param="ref_audio") from None
    state.metrics.ref_cache.labels(result="hit" if hit else "miss").inc()
    return codes, hit


def _own_voice(ref_text: str | None) -> ResolvedVoice:
    if ref_text is not None:
        raise bad_request("ref_text needs reference audio: send ref_audio or a registered voice",
                          param="ref_text")
    return ResolvedVoice(codes=None, ref_text=None, source="none")
