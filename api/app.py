"""The Starlette application: routes, middleware, and per-process state from ``lifespan``.

``create_app(profile, connect)`` builds one API process's app. ``connect`` is an async context
manager factory yielding this process's ``EngineClient`` (in-process, or rebuilt from a picklable
spec in a spawned API process); the lifespan opens it, builds the :class:`ApiState` around it and
yields it as ``request.state.api``. Nothing lives at module level.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route, WebSocketRoute

from api.auth import BearerAuthMiddleware
from api.clip_index import ClipIndex
from api.disk_budget import DiskBudget
from api.connection_limits import ConnectionGate
from api.errors import EXCEPTION_HANDLERS
from api.http_timeouts import BodyTimeoutMiddleware
from api.limits import BodyLimitMiddleware
from api.loop_lag import loop_lag_watched
from api.metrics import ApiMetrics
from api.origins import OriginCheckMiddleware
from api.ref_cache import ReferenceCodeCache, codec_namespace
from api.reference import ReferenceLoader, ReferencePolicy
from api.request_limits import RequestLimits
from api.routes import batch, demo, health, metrics, models, speech, text_to_speech, voices
from api.routes.speech_stream import speech_stream
from api.routes.text_to_speech_stream import multi_stream_input, stream_input
from api.schemas import openapi_document
from api.stream_socket import StreamSessions
from api.streaming import quiet_stream_cuts
from api.send_limits import HeldAudio, SendLimits
from api.voices import VoiceRegistry

if TYPE_CHECKING:
    from engine.client import EngineClient
    from profiles import Profile

Connect = Callable[[], AbstractAsyncContextManager["EngineClient"]]


@dataclass
class ApiState:
    """Everything a request handler of this API process needs."""

    profile: Profile
    client: EngineClient
    metrics: ApiMetrics
    references: ReferenceLoader
    limits: RequestLimits
    ref_cache: ReferenceCodeCache
    voices: VoiceRegistry
    streams: StreamSessions
    send_limits: SendLimits
    served_name: str
    model_names: tuple[str, ...]  # every name a request may use, the served name first
    openapi_json: bytes
    started_at: float


def data_dir(profile: Profile) -> Path:
    return Path(os.path.expanduser(profile.api.data_dir))


def build_state(profile: Profile, client: EngineClient, *, codec_id: str = "",
                connections: ConnectionGate | None = None) -> ApiState:
    root = data_dir(profile)
    namespace = codec_namespace(client.model_name, client.n_vq, client.sample_rate, client.channels, codec_id)
    policy = ReferencePolicy.from_profile(profile.api, sample_rate=client.sample_rate, channels=client.channels)
    served = profile.model.served_name
    limits = RequestLimits.for_engine(profile, channels=client.channels, n_vq=client.n_vq,
                                      samples_per_frame=client.variant.samples_per_frame)
    metrics = ApiMetrics(engine_counters=client.counters)
    disk = DiskBudget(root, (root / "ref_codes", root / "ref_clips"), profile.api.ref_cache_max_bytes,
                      on_evicted=metrics.ref_cache_evicted.inc)
    if connections is not None:
        connections.bind(metrics.connections_open.inc, metrics.limit_hit)
    return ApiState(
        profile=profile,
        client=client,
        metrics=metrics,
        references=ReferenceLoader(policy, index=ClipIndex(root / "ref_clips", budget=disk)),
        limits=limits,
        ref_cache=ReferenceCodeCache(root / "ref_codes", namespace, client.n_vq, client.encode_reference,
                                     budget=disk),
        voices=VoiceRegistry(root / "voices"),
        streams=StreamSessions(profile.stream.max_sessions, metrics.stream_sessions),
        send_limits=SendLimits(profile.api.send_timeout_s, profile.api.max_stream_buffer_bytes,
                               HeldAudio(profile.api.max_held_audio_bytes, metrics.held_audio.inc),
                               metrics.limit_hit),
        served_name=served,
        model_names=tuple(dict.fromkeys((served, client.model_name, *profile.model.aliases))),
        openapi_json=msgspec.json.encode(limits.apply_to_schema(openapi_document())),
        started_at=time.time(),
    )


# What a page on another origin may read of a response (the rest of the headers stay hidden).
EXPOSED_HEADERS = ("X-Audio-Sample-Rate", "X-Audio-Channels", "X-Audio-Format", "X-Audio-Seconds",
                   "X-Finish-Reason", "X-Output-Tokens", "X-Input-Characters", "X-Request-Id",
                   "X-Ref-Cache", "Retry-After")


def cors_middleware(origins: tuple[str, ...]) -> list[Middleware]:
    """Starlette's CORS middleware for ``api.cors_origins`` (none when empty). It goes first, so
    a preflight is answered before the key check (browsers send no key with it)."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST", "DELETE"],
                       allow_headers=["*"], expose_headers=list(EXPOSED_HEADERS), max_age=600)]


def create_app(profile: Profile, connect: Connect, *, codec_id: str = "",
               connections: ConnectionGate | None = None) -> Starlette:
    """The app of one API process; ``connections``: the process's connection gate (its counts go
    to ``/metrics``), where the server has one."""
    quiet_stream_cuts()  # a stream the engine could not finish is cut on purpose, not a crash

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with connect() as client:
            state = build_state(profile, client, codec_id=codec_id, connections=connections)
            async with loop_lag_watched(state.metrics.loop_lag.observe):
                yield {"api": state}

    routes = [
        Route("/v1/audio/speech", speech.create_speech, methods=["POST"]),
        Route("/v1/audio/speech/batch", batch.create_speech_batch, methods=["POST"]),
        WebSocketRoute("/v1/audio/speech/stream", speech_stream),
        Route("/v1/text-to-speech/{voice_id}", text_to_speech.create_speech, methods=["POST"]),
        Route("/v1/text-to-speech/{voice_id}/stream", text_to_speech.stream_speech, methods=["POST"]),
        Route("/v1/text-to-speech/{voice_id}/with-timestamps", text_to_speech.create_speech_with_timestamps,
              methods=["POST"]),
        Route("/v1/text-to-speech/{voice_id}/stream/with-timestamps",
              text_to_speech.stream_speech_with_timestamps, methods=["POST"]),
        WebSocketRoute("/v1/text-to-speech/{voice_id}/stream-input", stream_input),
        WebSocketRoute("/v1/text-to-speech/{voice_id}/multi-stream-input", multi_stream_input),
        Route("/v1/audio/voices", voices.list_voices, methods=["GET"]),
        Route("/v1/audio/voices", voices.create_voice, methods=["POST"]),
        Route("/v1/audio/voices/{name}", voices.get_voice, methods=["GET"]),
        Route("/v1/audio/voices/{name}", voices.delete_voice, methods=["DELETE"]),
        Route("/v1/models", models.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", models.get_model, methods=["GET"]),
        Route("/health", health.health, methods=["GET"]),
        Route("/ready", health.ready, methods=["GET"]),
        Route("/metrics", metrics.metrics, methods=["GET"]),
        Route("/openapi.json", demo.openapi, methods=["GET"]),
        Route("/", demo.index, methods=["GET"]),
    ]
    middleware = cors_middleware(profile.api.cors_origins) + [
        Middleware(OriginCheckMiddleware, allowed=tuple(profile.api.cors_origins)),
        Middleware(BodyLimitMiddleware, max_bytes=profile.api.max_body_bytes),
        Middleware(BodyTimeoutMiddleware, gap_s=profile.api.body_timeout_s, total_s=profile.api.body_deadline_s),
        Middleware(BearerAuthMiddleware, keys=tuple(profile.api.keys)),
    ]
    return Starlette(routes=routes, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS,
                     lifespan=lifespan)
