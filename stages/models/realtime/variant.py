"""MOSS-TTS-Realtime as a served variant: 16 codebooks, v1 codec (24 kHz mono), streaming from the
first frame.

The request adapter: `input` is the text to speak; an optional reference (`ref_codes`, one clip)
becomes the voice-timbre context block. Realtime has no continuation mode, instruction or
language field and takes one reference: a request that sets `ref_text`, `instructions`,
`language` or several references is refused with an `AdapterError` (HTTP 400) that says so,
rather than silently ignored. Sampling defaults: upstream's (models.md §5.4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ipc.messages import Sampling
from profiles import Profile
from stages.runtime.checkpoint import read_config
from stages.models.codec.serving import CodecShape, make_codec_runner
from stages.models.delay.adapters import AdapterError
from stages.models.delay.variant import talker_runner_options
from stages.models.realtime.config import RealtimeConfig
from stages.models.realtime.processor import RealtimeProcessor
from stages.registry import SpeechJobLike, to_wire
from stages.runtime.request_sampling import SamplingResolver
from stages.runtime.sampling import SamplingParams

# upstream inferencer defaults; max_length 5000 as infer.py (the class default is 1000)
SAMPLING_DEFAULTS = SamplingParams(temperature=0.8, top_p=0.6, top_k=30, repetition_penalty=1.1,
                                   max_new_frames=5000)


class RealtimeVariant:
    """One MOSS-TTS-Realtime checkpoint; see the module docstring."""

    name = "moss-tts-realtime"

    def __init__(self, model_dir: Path, profile: Profile, config: dict | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.profile = profile
        self.config = RealtimeConfig.from_dict(config if config is not None else read_config(model_dir))
        self.n_vq = self.config.rvq
        codec = CodecShape.of(self.model_dir, profile)
        self.codec_dir = codec.codec_dir
        self.sample_rate, self.channels = codec.sample_rate, codec.channels
        self.frame_rate, self.samples_per_frame = codec.frame_rate, codec.samples_per_frame
        self.sampling_defaults = to_wire(SAMPLING_DEFAULTS)
        self._sampling = SamplingResolver(self.sampling_defaults, profile)
        self._processor: RealtimeProcessor | None = None

    @property
    def processor(self) -> RealtimeProcessor:
        if self._processor is None:
            self._processor = RealtimeProcessor.from_dir(self.model_dir)
        return self._processor

    def build_request(self, job: SpeechJobLike) -> tuple[np.ndarray, Sampling]:
        """Prompt (prefill rows, then one row per text token still to stream) and sampling."""
        for field, why in (("ref_text", "it has no continuation mode; send ref_audio alone to clone a voice"),
                           ("instructions", "it has no instruction field"),
                           ("language", "it has no language field")):
            if getattr(job, field):
                raise AdapterError(f"MOSS-TTS-Realtime does not take {field}: {why}")
        if getattr(job, "extra_ref_codes", None):
            raise AdapterError("MOSS-TTS-Realtime takes one reference clip (ref_audio), not several")
        if not job.text or not job.text.strip():
            raise AdapterError("input text is required")
        try:
            prompt = self.processor.build_prompt(job.text, reference=job.ref_codes)
        except ValueError as e:  # bad reference codes, text that tokenizes to nothing
            raise AdapterError(str(e)) from None
        return prompt, self._sampling.resolve(job)

    def prime_frames(self, job: SpeechJobLike) -> int:
        """0: the reference is voice context for the talker, not audio to continue."""
        return 0

    def make_talker_runner(self, device: str) -> Any:
        from stages.models.local_v15.loader import resolve_dtype
        from stages.models.realtime.runner import RealtimeRunner

        return RealtimeRunner.from_dir(self.model_dir, device=device,
                                       dtype=resolve_dtype(self.profile.model.dtype, device),
                                       **talker_runner_options(self.profile, device))

    def make_codec_runner(self, device: str) -> Any:
        return make_codec_runner(self.codec_dir, self.profile, device, self.n_vq)
