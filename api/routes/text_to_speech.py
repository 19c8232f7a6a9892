"""ElevenLabs' text-to-speech over HTTP: ``POST /v1/text-to-speech/{voice_id}`` and its variants.

- ``/v1/text-to-speech/{voice_id}``: the whole file at once;
- ``/v1/text-to-speech/{voice_id}/stream``: the file's bytes as they are made (chunked);
- ``/v1/text-to-speech/{voice_id}/with-timestamps``: one JSON object, the file in
  ``audio_base64``;
- ``/v1/text-to-speech/{voice_id}/stream/with-timestamps``: one JSON object per line as the audio
  is made, each piece in ``audio_base64``.
Character timestamps are not supported: ``alignment`` and ``normalized_alignment`` are always
null. The query takes ``output_format`` (default ``mp3_44100_128``); ``enable_logging`` and
``optimize_streaming_latency`` are accepted (the second reported as ignored). The body and its
mapping onto this server's speech request are in `api.elevenlabs_request`; the request then runs
as ``POST /v1/audio/speech`` does (`api.routes.speech.start_speech`), and its errors take
ElevenLabs' shape (`api.errors.elevenlabs_error_body`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from api.elevenlabs_request import (HTTP_DEFAULT_FORMAT, decode_body, elevenlabs_names, given,
                                    in_elevenlabs_terms, output_format, refuse_unused, speech_request,
                                    voice_speed)
from api.errors import ApiError
from api.json_body import read_json_body
from api.routes.speech import RequestTracker, Started, raw_stream, start_speech, tracked, whole_answer
from api.streaming import AudioStreamResponse, WholeAudioResponse

JSON = "application/json"


async def create_speech(request: Request) -> Response:
    """The whole file at once."""
    return await tracked(request, lambda r, s, t: _respond(r, s, t, mode="file", timestamps=False))


async def stream_speech(request: Request) -> Response:
    """The file's bytes as they are made."""
    return await tracked(request, lambda r, s, t: _respond(r, s, t, mode="audio", timestamps=False))


async def create_speech_with_timestamps(request: Request) -> Response:
    """One JSON object with the whole file in base64."""
    return await tracked(request, lambda r, s, t: _respond(r, s, t, mode="file", timestamps=True))


async def stream_speech_with_timestamps(request: Request) -> Response:
    """One JSON line per piece of the file, as it is made."""
    return await tracked(request, lambda r, s, t: _respond(r, s, t, mode="audio", timestamps=True))


async def _respond(request: Request, state, tracker: RequestTracker, *, mode: str,
                   timestamps: bool) -> Response:
    try:
        started, text = await _start(request, state, tracker, mode=mode)
    except ApiError as exc:
        raise in_elevenlabs_terms(exc) from None
    headers, limits = started.headers, state.send_limits
    if mode == "file":
        audio, hold = await whole_answer(started, tracker, request.receive, state)
        headers.update(tracker.usage_headers(text))
        if not timestamps:
            return WholeAudioResponse(audio, media_type=started.encoder.content_type, headers=headers,
                                      limits=limits, holds=(hold,))
        return WholeAudioResponse(json.dumps(_piece(audio)).encode(), media_type=JSON, headers=headers,
                                  limits=limits, holds=(hold,))
    body = raw_stream(started.first, started.chunks, started.encoder, tracker, tracker.request_id)
    if timestamps:
        body = _json_lines(body)
    return AudioStreamResponse(body, media_type=JSON if timestamps else started.encoder.content_type,
                               headers=headers, limits=limits)


async def _start(request: Request, state, tracker: RequestTracker, *, mode: str) -> tuple[Started, str]:
    """The request parsed, mapped and started (its first chunk in), and its text."""
    query = request.query_params
    fmt = output_format(query.get("output_format"), HTTP_DEFAULT_FORMAT)
    body, unused = decode_body(await read_json_body(request))
    tracker.parsed_at = time.monotonic()
    unused += tuple(name for name in ("optimize_streaming_latency",) if given(name, query.get(name)))
    req, foreign = speech_request(body.text, request.path_params["voice_id"], fmt=fmt,
                                  model_id=body.model_id, language_code=body.language_code,
                                  speed=voice_speed(body.voice_settings), seed=body.seed,
                                  model_names=state.model_names)
    unused = foreign + unused
    refuse_unused(unused, strict=state.profile.api.strict_fields)
    started = await start_speech(req, state, tracker, request.receive,
                                 plan=fmt.plan(mode=mode, speed=req.speed), ignored=unused)
    started.fields = dataclasses.replace(started.fields, ignored=elevenlabs_names(started.fields.ignored))
    started.headers.update(started.fields.headers())
    return started, body.text


def _piece(audio: bytes) -> dict:
    """One with-timestamps object: the audio, and no alignment (not supported)."""
    return {"audio_base64": base64.b64encode(audio).decode(), "alignment": None,
            "normalized_alignment": None}


async def _json_lines(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Each piece of the file as one JSON line; closing this closes ``body`` (which aborts the
    request when the client left)."""
    async with contextlib.aclosing(body):
        async for data in body:
            yield json.dumps(_piece(data)).encode() + b"\n"
