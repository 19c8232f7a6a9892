"""A session's settings: its `session.config` checked, its voice resolved, its output planned.

Built once per `session.config` (the voice's reference audio is decoded and encoded then, through
the shared code cache; the output layout is the speech request's: `pcm` in OpenAI's 24 kHz mono
unless `sample_rate`/`channels` or `api.pcm_layout` say otherwise), then used for every sentence:
`job(text)` is the engine request of one piece of text, `encoder()` a fresh audio encoder for it
and `done_fields(text)` what its `audio.done` reports of the config's fields. A config the model
cannot serve is refused here, before any text is spoken (the variant builds a probe request).
Fields the served model does not use are screened out first, as for `POST /v1/audio/speech`
(`api.fields`): ignored and reported in every `audio.done`, or, under `api.strict_fields`, a 400
for the `session.config`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from api.audio_encoding import AudioEncoder, make_encoder
from api.errors import bad_request
from api.fields import FieldReport, screen_fields
from api.speech_job import ResolvedVoice, check_request, output_plan, resolve_voice, sampling_overrides
from api.stream_protocol import SessionFields, session_fields
from speech.job import SpeechJob

log = logging.getLogger("mossvox.api")


@dataclass(frozen=True)
class SessionSettings:
    fields: SessionFields
    voice: ResolvedVoice
    sample_rate: int      # the model's
    channels: int
    out_rate: int         # what the client gets (the speech request's output layout)
    out_channels: int
    report: FieldReport   # the config's fields the model ignored
    default_speaker: Callable[[str], str | None]  # the variant's: the speaker of untagged text

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

    def done_fields(self, text: str) -> dict:
        """What a sentence's `audio.done` says of the fields: those the model ignored
        (`ignored_fields`) and, for untagged text to a multi-speaker model, its speaker."""
        return dataclasses.replace(self.report, untagged_speaker=self.default_speaker(text)).event_fields()

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
    req, report = screen_fields(req, client.variant, strict=state.profile.api.strict_fields)
    if report.ignored:
        log.debug("speech session: %s does not use %s; ignored", client.model_name, ", ".join(report.ignored))
    fields = dataclasses.replace(fields, request=req)
    voice = await resolve_voice(req, state)
    settings = SessionSettings(fields, voice, client.sample_rate, client.channels, plan.sample_rate,
                               plan.channels, report, client.variant.default_speaker)
    try:
        settings.encoder()
    except ValueError as exc:
        raise bad_request(str(exc), param="response_format") from None
    try:
        client.variant.build_request(settings.job("probe"))
    except ValueError as exc:  # the variant's adapter refuses the configuration
        raise bad_request(str(exc)) from None
    return settings
