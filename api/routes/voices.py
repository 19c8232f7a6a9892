"""Voice registry routes: ``POST/GET /v1/audio/voices``, ``GET/DELETE /v1/audio/voices/{name}``.

Upload is multipart (``audio`` file, ``name``, ``consent``, optional ``ref_text`` and
``overwrite``). The clip is decoded and validated like ``ref_audio``, encoded at once (through the
shared reference-code cache) and stored with its codes, so the first synthesis with the voice is
already hot. A built-in voice name (``alloy``, ``default``, ...) is refused, so an upload never
shadows one; a name already registered is a 409 unless the upload says ``overwrite=true``.
"""

from __future__ import annotations

import asyncio
import os

import msgspec
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response

from api.errors import ApiError, bad_request
from api.schemas import MAX_CONSENT_CHARS, VoiceCreated, VoiceDeleted, VoiceList
from api.speech_job import OPENAI_VOICES, reference_codes
from api.voices import VoiceExists, valid_voice_name

_json = msgspec.json.Encoder()


def json_response(value, status: int = 200) -> Response:
    return Response(_json.encode(value), status_code=status, media_type="application/json",
                    headers={"X-Api-Process": str(os.getpid())})


async def list_voices(request: Request) -> Response:
    voices = await asyncio.to_thread(request.state.api.voices.list)
    return json_response(VoiceList(voices=[v.name for v in voices], uploaded_voices=voices))


async def get_voice(request: Request) -> Response:
    name = request.path_params["name"]
    voice = await asyncio.to_thread(request.state.api.voices.get, name)
    if voice is None:
        raise ApiError(404, f"Voice '{name}' not found", param="name", code="voice_not_found")
    return json_response(voice.info)


async def delete_voice(request: Request) -> Response:
    name = request.path_params["name"]
    if not await asyncio.to_thread(request.state.api.voices.delete, name):
        raise ApiError(404, f"Voice '{name}' not found", param="name", code="voice_not_found")
    return json_response(VoiceDeleted(success=True, name=name))


async def create_voice(request: Request) -> Response:
    state = request.state.api
    limits = state.profile.api
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise bad_request("Upload a voice as multipart/form-data with fields audio, name, consent")
    async with request.form(max_files=1, max_fields=8, max_part_size=limits.max_ref_bytes) as form:
        name = _text(form, "name", required=True)
        consent = _text(form, "consent", required=True)
        ref_text = _text(form, "ref_text") or None
        overwrite = _flag(form, "overwrite")
        upload = form.get("audio") or form.get("audio_sample")
        if not isinstance(upload, UploadFile):
            raise bad_request("The form needs an audio file part named 'audio'", param="audio")
        data = await upload.read(limits.max_ref_bytes + 1)
    _check_length("consent", consent, MAX_CONSENT_CHARS, "")
    _check_length("ref_text", ref_text or "", state.limits.max_input_chars, " (api.max_input_chars)")
    if not valid_voice_name(name):
        raise bad_request("Voice names are 1-64 characters of letters, digits, '_', '-' and '.', "
                          "starting with a letter or digit", param="name")
    if name.lower() in OPENAI_VOICES:
        raise bad_request(f"'{name}' is a built-in voice name (the model's own voice); choose another "
                          f"name", param="name", code="reserved_voice_name")
    existing = await asyncio.to_thread(state.voices.names)
    if name in existing and not overwrite:
        raise _taken(name)
    if name not in existing and len(existing) >= limits.max_voices:
        raise bad_request(f"The server already holds {len(existing)} voices (api.max_voices); "
                          f"delete one first", param="name")
    prepared = await asyncio.to_thread(state.references.prepare_bytes, data, param="audio")
    codes, _ = await reference_codes(state, prepared)
    try:
        voice = await asyncio.to_thread(state.voices.put, name=name, codes=codes, namespace=state.ref_cache.namespace,
                                        consent=consent, duration_s=prepared.duration_s, ref_text=ref_text,
                                        overwrite=overwrite)
    except VoiceExists:  # registered meanwhile, through another request or API process
        raise _taken(name) from None
    return json_response(VoiceCreated(success=True, voice=voice.info))


def _taken(name: str) -> ApiError:
    return ApiError(409, f"Voice '{name}' already exists; send overwrite=true to replace it, or choose "
                         f"another name", param="name", code="voice_exists")


def _flag(form, key: str) -> bool:
    value = _text(form, key).lower()
    if value in ("", "false", "0", "no", "off"):
        return False
    if value in ("true", "1", "yes", "on"):
        return True
    raise bad_request(f"Form field '{key}' must be true or false", param=key)


def _text(form, key: str, required: bool = False) -> str:
    value = form.get(key)
    if isinstance(value, UploadFile):
        raise bad_request(f"Form field '{key}' must be text, not a file", param=key)
    value = (value or "").strip()
    if required and not value:
        raise bad_request(f"Form field '{key}' is required", param=key)
    return value


def _check_length(key: str, value: str, limit: int, source: str) -> None:
    if len(value) > limit:
        raise bad_request(f"Form field '{key}' is {len(value)} characters; the limit is {limit}{source}",
                          param=key)
