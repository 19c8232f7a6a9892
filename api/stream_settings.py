"""A session's settings: its `session.config` checked, its voice resolved, its output planned.

Built once per `session.config` (the voice's reference audio is decoded and encoded then, through
the shared code cache; the output layout is the speech request's: `pcm` in OpenAI's 24 kHz mono
unless `sample_rate`/`channels` or `api.pcm_layout` say otherwise), then used for every sentence: `job(text)` is the engine request of one
piece of text and `encoder()` a fresh audio encoder for it. A config the model cannot serve is
refused here, before any text is spoken (the variant builds a probe request).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from api.audio_encoding import AudioEncoder, make_encoder
from api.errors import bad_request
from api.speech_job import ResolvedVoice, check_request, output_plan, resolve_voice, sampling_overrides
from api.stream_protocol import SessionFields, session_fields
from speech.job import SpeechJob


@dataclass(frozen=True)
class SessionSettings:
    fields: SessionFields
    voice: ResolvedVoice
    sample_rate: int      # the model's
    channels: int
    out_rate: int         # what the client gets (the speech request's output layout)
    out_channels: int

    @property
    def response_format(self) -> str:
        return self.fields.request.response_format

    @property
    def split_granularity(self) -> str:
        return self.fields.split_granularity

    @property
    def stream_audio(self) -> bool:
        return self.fields.stream_audio

    def job(self, text: str, *, context_codes: np.ndarray | None = None,
            context_text: str | None = None) -> SpeechJob:
        """The engine request for `text`, optionally continuing audio just spoken."""
        req, voice = self.fields.request, self.voice
        return SpeechJob(text=text, language=req.language, instructions=req.instructions,
                         ref_codes=voice.codes, ref_text=voice.ref_text,
                         extra_ref_codes=list(voice.extra_codes), sampling=sampling_overrides(req),
                         initial_chunk_frames=req.initial_codec_chunk_frames,
                         forced_frames=req.forced_frames, context_codes=context_codes,
                         context_text=context_text)

    def encoder(self) -> AudioEncoder:
        req = self.fields.request
        return make_encoder(req.response_format, self.sample_rate, self.channels, streaming=True,
                            speed=req.speed, out_rate=self.out_rate, out_channels=self.out_channels)


async def load_settings(body: dict, state) -> SessionSettings:
    """A `session.config` body → settings; `ApiError` for anything the request would refuse."""
    fields = session_fields(body)
    req, client = fields.request, state.client
    check_request(req, model_names=state.model_names, limits=state.limits, sample_rate=client.sample_rate)
    plan = output_plan(req, native_rate=client.sample_rate, native_channels=client.channels,
                       pcm_layout=state.profile.api.pcm_layout)
    voice = await resolve_voice(req, state)
    settings = SessionSettings(fields, voice, client.sample_rate, client.channels, plan.sample_rate,
                               plan.channels)
    try:
        settings.encoder()
    except ValueError as exc:
        raise bad_request(str(exc), param="response_format") from None
    try:
        client.variant.build_request(settings.job("probe"))
    except ValueError as exc:  # the variant's adapter refuses the configuration
        raise bad_request(str(exc)) from None
    return settings
