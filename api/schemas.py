"""Request and response records of the HTTP API.

The same msgspec Structs validate request bodies (``decode_body``) and generate the
``/openapi.json`` document (``openapi_document``), so the published schema is exactly what the
server enforces.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect
from msgspec import Meta, Struct

from api.errors import ApiError, bad_request
from api.json_body import decode_typed

ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
StreamFormat = Literal["audio", "sse"]
Probability = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0, le=1_000_000, description="0 or at least the vocabulary size: no limit")]
Name = Annotated[str, Meta(max_length=256)]
Tag = Annotated[str, Meta(max_length=64)]
MAX_CONSENT_CHARS = 1000


class VoiceObject(Struct, forbid_unknown_fields=True):
    """``voice`` given as an object, as newer OpenAI clients send it."""

    id: Name


class ExtraParams(Struct, forbid_unknown_fields=True):
    """Sampling values accepted inside ``extra_params`` (vLLM-Omni style); top-level fields win."""

    temperature: Annotated[float, Meta(ge=0.0, le=10.0)] | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None


class SpeechRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/audio/speech`` (OpenAI fields first, then MOSS / vLLM-Omni fields)."""

    input: Annotated[str, Meta(description="Text to speak.")]
    model: Name | None = None
    voice: Annotated[
        Name | VoiceObject | None,
        Meta(description="A registered voice name, {\"id\": name}, or 'default' / an OpenAI "
                         "built-in name for the model's own voice."),
    ] = None
    instructions: str | None = None
    response_format: ResponseFormat = "mp3"
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] = 1.0
    stream_format: Annotated[
        StreamFormat | None,
        Meta(description="audio: the file's bytes as they are made (chunked transfer), the default "
                         "for every format but flac; sse: server-sent events. Unset with "
                         "stream=false, or for flac: the whole file at once."),
    ] = None
    stream: Annotated[
        bool | None,
        Meta(description="true: server-sent events (as stream_format=sse); false: the whole file at "
                         "once, with its length, finish reason and usage in the headers."),
    ] = None
    ref_audio: Annotated[
        str | Annotated[list[str], Meta(min_length=1, max_length=5)] | None,
        Meta(description="Reference audio: data: URL, bare base64, file:// or a path under an "
                         "allowed directory, or http(s) when the server allows remote fetch. A "
                         "list gives one clip per speaker (TTSD: [S1], [S2], ...)."),
    ] = None
    ref_text: str | None = None
    language: Tag | None = None
    task_type: Tag | None = None
    max_new_tokens: Annotated[int, Meta(ge=1, le=100_000)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=10.0)] | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    extra_params: ExtraParams | None = None
    initial_codec_chunk_frames: Annotated[
        Annotated[int, Meta(ge=1, le=100_000)] | None,
        Meta(description="Frames in the first audio chunk (the rest follow the server's schedule); "
                         "at most what one record of the server's PCM ring holds."),
    ] = None
    sample_rate: Annotated[
        Annotated[int, Meta(gt=0, le=384_000)] | None,
        Meta(description="Output sample rate: the model's own or one of 8000, 11025, 12000, 16000, "
                         "22050, 24000, 32000, 44100, 48000 (resampled on the fly). Default: the "
                         "model's, but 24000 for pcm (OpenAI's layout) unless the server's "
                         "api.pcm_layout is native.")
    ] = None
    channels: Annotated[
        Literal[1, 2] | None,
        Meta(description="Output channels (stereo to mono is the mean of the two). Default: the "
                         "model's, but 1 for pcm (OpenAI's layout) unless the server's "
                         "api.pcm_layout is native."),
    ] = None
    forced_frames: Annotated[
        Annotated[int, Meta(ge=1, le=100_000)] | None,
        Meta(description="Benchmark feature for random-weight checkpoints: generate exactly this "
                         "many frames (random weights stop at random); at most the "
                         "server's frame cap."),
    ] = None


class TextToSpeechBody(Struct, kw_only=True):
    """Body of ``POST /v1/text-to-speech/{voice_id}`` (and ``/stream``, ``/with-timestamps``,
    ``/stream/with-timestamps``), as ElevenLabs defines it. ``text``, ``model_id``,
    ``language_code``, ``voice_settings.speed`` and ``seed`` are used; the rest are accepted and
    reported as ignored when set (``X-Ignored-Fields``)."""

    text: Annotated[str, Meta(description="Text to speak.")]
    model_id: Annotated[str | None, Meta(
        description="The served model's name, or any other (an ElevenLabs model id: ignored and "
                    "reported).")] = None
    language_code: Annotated[str, Meta(max_length=64)] | None = None
    voice_settings: Annotated[dict[str, Any] | None, Meta(
        description="speed (0.25-4) is used; stability, similarity_boost, style and "
                    "use_speaker_boost are ignored and reported.")] = None
    seed: Annotated[int, Meta(ge=0, le=4294967295)] | None = None
    pronunciation_dictionary_locators: list[Any] | None = None
    previous_text: str | None = None
    next_text: str | None = None
    previous_request_ids: list[str] | None = None
    next_request_ids: list[str] | None = None
    use_pvc_as_ivc: bool | None = None
    apply_text_normalization: Literal["auto", "on", "off"] | None = None
    apply_language_text_normalization: bool | None = None


class ElevenLabsErrorDetail(Struct):
    status: str
    message: str


class ElevenLabsError(Struct):
    """An error of the ElevenLabs-compatible routes, in ElevenLabs' shape (a 422 lists the
    failing body fields instead, as ``detail``: ``[{loc, msg, type}]``)."""

    detail: ElevenLabsErrorDetail


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(Struct):
    error: ErrorDetail


class SpeechBatchRequest(Struct, kw_only=True):
    """Body of ``POST /v1/audio/speech/batch`` as documented; ``api.routes.batch`` parses it."""

    items: Annotated[list[SpeechRequest], Meta(
        min_length=1, description="1 to api.max_batch_items (32 by default) speech requests. Any other "
                                  "field of a speech request but input, stream and stream_format may "
                                  "also stand beside items, as a default for every item.")]


class SpeechUsage(Struct):
    """What one response took and made."""

    input_characters: int
    output_tokens: int  # frames generated
    output_frames: int
    audio_seconds: float  # the file's length, after speed


class SpeechBatchItem(Struct, kw_only=True, omit_defaults=True):
    """One item of a batch response: the file and its facts, or the item's error."""

    index: int
    status: Literal["success", "error"]
    audio_data: Annotated[str | None, Meta(description="The whole file, base64.")] = None
    media_type: str | None = None
    response_format: str | None = None
    sample_rate: int | None = None
    channels: int | None = None
    finish_reason: Literal["stop", "length"] | None = None
    usage: SpeechUsage | None = None
    ignored_fields: Annotated[list[str] | None, Meta(
        description="The item's fields the served model does not use, ignored (X-Ignored-Fields).")] = None
    untagged_speaker: Annotated[str | None, Meta(
        description="The speaker that text without speaker tags went to (X-Untagged-Speaker).")] = None
    status_code: Annotated[int | None, Meta(description="The HTTP status the item alone would get.")] = None
    error: ErrorDetail | None = None


class SpeechBatchResponse(Struct, kw_only=True):
    id: str
    object: str = "speech.batch"
    results: list[SpeechBatchItem]
    total: int
    succeeded: int
    failed: int


class ModelCard(Struct):
    """A served model: the OpenAI fields, the PCM layout, ``root`` (the model family's own name,
    as vLLM lists it) and ``request_fields`` (the optional request fields it uses; it ignores the
    others, or refuses them under ``api.strict_fields``)."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "mossvox"
    sample_rate: int = 0
    channels: int = 0
    root: str | None = None
    request_fields: list[str] = []


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class VoiceUploadForm(Struct, kw_only=True):
    """Multipart form of ``POST /v1/audio/voices`` (``audio`` is the file part). ``name`` may not
    be a built-in voice's; a registered one is replaced only with ``overwrite`` (else 409)."""

    audio: Annotated[bytes, Meta(description="Reference audio file (any common format).")]
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    consent: Annotated[str, Meta(min_length=1, max_length=MAX_CONSENT_CHARS,
                                 description="Consent statement or id from the voice owner.")]
    ref_text: Annotated[str | None, Meta(description="Transcript of the clip; at most the server's "
                                                     "input limit (api.max_input_chars).")] = None
    overwrite: Annotated[bool, Meta(description="Replace a voice registered under this name.")] = False


class VoiceInfo(Struct, kw_only=True):
    """A registered voice as listed by the API (codes stay on the server)."""

    name: str
    consent: str
    created_at: float
    duration_s: float
    frames: int
    ref_text: str | None = None


class VoiceList(Struct):
    voices: list[str]
    uploaded_voices: list[VoiceInfo]


class VoiceCreated(Struct):
    success: bool
    voice: VoiceInfo


class VoiceDeleted(Struct):
    success: bool
    name: str


_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN_RE = re.compile(r"unknown field `([^`]*)`")
_speech_decoder = msgspec.json.Decoder(SpeechRequest)


def decode_speech_request(body: bytes) -> SpeechRequest:
    """Validate a JSON body; any schema error becomes a 400 naming the field."""
    try:
        return decode_typed(_speech_decoder, body)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc) from None


def speech_request_from(fields: dict) -> SpeechRequest:
    """A speech request from already decoded JSON (a batch item); errors as in
    ``decode_speech_request``."""
    try:
        return msgspec.convert(fields, SpeechRequest)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: msgspec.ValidationError) -> ApiError:
    """A 400 naming the field; a value outside a field's choices lists the valid ones."""
    text = str(exc)
    match = _PATH_RE.search(text) or _UNKNOWN_RE.search(text)
    param = match.group(1) if match else None
    if param and text.startswith("Invalid enum value"):
        choices = field_choices(SpeechRequest, param)
        if choices:
            text += f"; expected one of: {', '.join(map(str, choices))}"
    return bad_request(text, param=param or None)


def field_choices(struct: type, path: str) -> list:
    """The values a `Literal` field at `path` (dotted, under `struct`) accepts, in order; [] for a
    field without a fixed set of values."""
    info: object = msgspec.inspect.type_info(struct)
    for name in path.split("."):
        structs = [t for t in _alternatives(info) if isinstance(t, msgspec.inspect.StructType)]
        field = next((f for s in structs for f in s.fields if f.encode_name == name), None)
        if field is None:
            return []
        info = field.type
    return [v for t in _alternatives(info) if isinstance(t, msgspec.inspect.LiteralType) for v in t.values]


def _alternatives(info: object) -> list:
    """`info` without its constraints, a union as its members."""
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    if isinstance(info, msgspec.inspect.UnionType):
        return [t for member in info.types for t in _alternatives(member)]
    return [info]


# --------------------------------------------------------------------------- OpenAPI


def _json_body(name: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": _ref(name)}}}}


def _ref(name: str) -> str:
    return f"#/components/schemas/{name}"


def _json_response(name: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _ref(name)}}}}


def openapi_document(title: str = "mossvox", version: str = "0.1.0") -> dict:
    """The OpenAPI 3.1 document, built from the Structs above."""
    _, components = msgspec.json.schema_components(
        [SpeechRequest, SpeechBatchRequest, SpeechBatchResponse, VoiceUploadForm, ModelList, ModelCard,
         VoiceList, VoiceCreated, VoiceDeleted, ErrorEnvelope, TextToSpeechBody, ElevenLabsError],
        ref_template="#/components/schemas/{name}",
    )
    audio_types = ["audio/mpeg", "audio/ogg", "audio/aac", "audio/flac", "audio/wav", "audio/pcm",
                   "text/event-stream"]
    errors = {str(s): _json_response("ErrorEnvelope", d) for s, d in [
        (400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model or voice"),
        (409, "Voice name taken; see overwrite"), (413, "Body too large"),
        (429, "Admission rejected; see Retry-After"), (503, "Not ready or overloaded; see Retry-After")]}
    paths = {
        "/v1/audio/speech": {"post": {
            "operationId": "createSpeech", "requestBody": _json_body("SpeechRequest"),
            "responses": {"200": {"description": "Audio, streamed while it is generated (chunked "
                                                 "transfer) unless stream=false or flac; SSE with "
                                                 "stream_format=sse",
                                  "content": {t: {} for t in audio_types}}, **errors}}},
        "/v1/audio/speech/batch": {"post": {
            "operationId": "createSpeechBatch", "requestBody": _json_body("SpeechBatchRequest"),
            "responses": {"200": _json_response("SpeechBatchResponse", "Each item's file or error, "
                                                                       "in the items' order"),
                          **errors}}},
        "/v1/audio/voices": {
            "get": {"operationId": "listVoices", "responses": {"200": _json_response("VoiceList", "Voices")}},
            "post": {"operationId": "createVoice",
                     "requestBody": {"required": True, "content": {"multipart/form-data": {
                         "schema": {"$ref": _ref("VoiceUploadForm")}}}},
                     "responses": {"200": _json_response("VoiceCreated", "Registered"), **errors}}},
        "/v1/audio/voices/{name}": {
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
            "get": {"operationId": "getVoice", "responses": {"200": {"description": "Voice", "content": {
                "application/json": {"schema": {"$ref": _ref("VoiceInfo")}}}}, **errors}},
            "delete": {"operationId": "deleteVoice",
                       "responses": {"200": _json_response("VoiceDeleted", "Deleted"), **errors}}},
        **_text_to_speech_paths(audio_types[:-1]),
        "/v1/models": {"get": {"operationId": "listModels",
                               "responses": {"200": _json_response("ModelList", "Models")}}},
        "/v1/models/{model}": {
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "get": {"operationId": "retrieveModel",
                    "responses": {"200": _json_response("ModelCard", "Model"), **errors}}},
        "/health": {"get": {"operationId": "health", "responses": {"200": {"description": "Alive"}}}},
        "/ready": {"get": {"operationId": "ready", "responses": {
            "200": {"description": "Models loaded and warmed up"}, "503": {"description": "Not ready"}}}},
        "/metrics": {"get": {"operationId": "metrics", "responses": {"200": {"description": "Prometheus"}}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _text_to_speech_paths(audio_types: list[str]) -> dict:
    """The ElevenLabs-compatible routes (`api.routes.text_to_speech`)."""
    params = [
        {"name": "voice_id", "in": "path", "required": True, "schema": {"type": "string"},
         "description": "A registered voice, or default (or an OpenAI voice name) for the model's own."},
        {"name": "output_format", "in": "query", "required": False, "schema": {
            "type": "string", "pattern": "^(mp3|pcm|ulaw|alaw|opus)_[0-9]+(_[0-9]+)?$",
            "default": "mp3_44100_128"}, "description": "codec_rate[_kbps], mono: pcm_16000, "
                                                        "mp3_44100_128, ulaw_8000, opus_48000_64, ..."},
        {"name": "enable_logging", "in": "query", "required": False, "schema": {"type": "boolean"}},
        {"name": "optimize_streaming_latency", "in": "query", "required": False,
         "schema": {"type": "integer"}, "description": "Accepted and ignored."},
    ]
    errors = {str(s): _json_response("ElevenLabsError", d) for s, d in [
        (400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown voice"),
        (422, "Body fails validation"), (429, "Admission rejected; see Retry-After"),
        (503, "Not ready or overloaded; see Retry-After")]}
    timestamped = {"description": "JSON with the audio in audio_base64 (alignment: null)",
                   "content": {"application/json": {}}}
    audio = {"description": "Audio", "content": {t: {} for t in audio_types}}
    routes = {"": ("textToSpeech", audio), "/stream": ("streamTextToSpeech", audio),
              "/with-timestamps": ("textToSpeechWithTimestamps", timestamped),
              "/stream/with-timestamps": ("streamTextToSpeechWithTimestamps", timestamped)}
    return {f"/v1/text-to-speech/{{voice_id}}{tail}": {"post": {
        "operationId": operation, "parameters": params, "requestBody": _json_body("TextToSpeechBody"),
        "responses": {"200": ok, **errors}}} for tail, (operation, ok) in routes.items()}
