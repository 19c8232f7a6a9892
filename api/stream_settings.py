"""A session's settings: its `session.config` checked, its voice resolved, its output planned.

Built once per `session.config` (the voice's reference audio is decoded and encoded then, through
the shared code cache; the output layout is the speech request's: `pcm` in OpenAI's 24 kHz mono
unless `sample_rate`/`channels` or `api.pcm_layout` say otherwise), or by another protocol from
its own fields (`settings_for`, with its own output plan), then used for every sentence:
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
from api.speech_job import (OutputPlan, ResolvedVoice, check_request, output_plan, resolve_voice,
                            sampling_overrides)
from api.stream_protocol import SessionFields, session_fields
from speech.job import SpeechJob

log = logging.getLogger("mossvox.api")


@dataclass(frozen=True)
class SessionSettings:
    fields: SessionFields
    voice: ResolvedVoice
    sample_rate: int      # the model's
    channels: int
    output: OutputPlan    # what the client gets: format, layout, speed, bit rate
    report: FieldReport   # the config's fields the model ignored
    default_speaker: Callable[[str], str | None]  # the variant's: the speaker of untagged text

    @property
    def response_format(self) -> str:
        return self.output.response_format

    @property
    def out_rate(self) -> int:
        return self.output.sample_rate

    @property
    def out_channels(self) -> int:
        return self.output.channels

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
        out = self.output
        return make_encoder(out.response_format, self.sample_rate, self.channels, streaming=True,
                            speed=out.speed, out_rate=out.sample_rate, out_channels=out.channels,
                            bit_rate=out.bit_rate)


async def load_settings(body: dict, state) -> SessionSettings:
    """A `session.config` body → settings; `ApiError` for anything the request would refuse."""
    return await settings_for(session_fields(body), state)


async def settings_for(fields: SessionFields, state, *, plan: OutputPlan | None = None,
                       ignored: tuple[str, ...] = ()) -> SessionSettings:
    """Settings from checked session fields; `plan` replaces the output the speech request asks
    for, `ignored` names the caller's own fields that nothing uses (reported with the others)."""
    req, client = fields.request, state.client
    check_request(req, model_names=state.model_names, limits=state.limits, sample_rate=client.sample_rate)
    if plan is None:
        plan = output_plan(req, native_rate=client.sample_rate, native_channels=client.channels,
                           pcm_layout=state.profile.api.pcm_layout)
    req, report = screen_fields(req, client.variant, strict=state.profile.api.strict_fields)
    if report.ignored:
        log.debug("speech session: %s does not use %s; ignored", client.model_name, ", ".join(report.ignored))
    if ignored:
        report = dataclasses.replace(report, ignored=(*report.ignored, *ignored))
    fields = dataclasses.replace(fields, request=req)
    voice = await resolve_voice(req, state)
    settings = SessionSettings(fields, voice, client.sample_rate, client.channels, plan, report,
                               client.variant.default_speaker)
    try:
        settings.encoder()
    except ValueError as exc:
        raise bad_request(str(exc), param="response_format") from None
    try:
        client.variant.build_request(settings.job("probe"))
    except ValueError as exc:  # the variant's adapter refuses the configuration
        raise bad_request(str(exc)) from None
    return settings
