"""The MOSS-TTS-Local-Transformer-v1.5 variant: runners, prompt adapter, sampling defaults.

The request adapter (`build_request`) runs in the API process: it turns an engine-level speech job
into the prompt `[S, 1 + n_vq]` and the resolved `Sampling`, so the engine never tokenizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ipc.messages import Sampling
from profiles import Profile
from stages.runtime.checkpoint import read_config
from stages.models.codec.config import CodecConfig
from stages.models.local_v15.processor import LocalV15Processor
from stages.registry import SpeechJobLike, to_wire
from stages.runtime.request_sampling import SamplingResolver
from stages.runtime.sampling import SamplingParams

CODEC_SUBDIR = "audio_tokenizer"


class LocalV15Variant:
    """MOSS-TTS-Local-Transformer-v1.5 with MOSS-Audio-Tokenizer-v2 (48 kHz stereo at full size)."""

    name = "moss-tts-local-v1.5"

    def __init__(self, model_dir: Path, profile: Profile, config: dict | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.profile = profile
        self.config = config if config is not None else read_config(model_dir)
        self.codec_dir = Path(profile.model.codec_path or self.model_dir / CODEC_SUBDIR)
        codec_cfg = CodecConfig.from_json(read_config(self.codec_dir))
        self.n_vq = int(self.config["n_vq"])
        self.sample_rate = codec_cfg.sampling_rate
        self.channels = codec_cfg.channels
        self.frame_rate = codec_cfg.frame_rate
        self.samples_per_frame = codec_cfg.downsample_rate
        self.sampling_defaults = to_wire(SamplingParams(max_new_frames=profile.model.max_new_frames))
        self._sampling = SamplingResolver(self.sampling_defaults, profile)
        self._processor: LocalV15Processor | None = None

    @property
    def processor(self) -> LocalV15Processor:
        if self._processor is None:
            self._processor = LocalV15Processor.from_dir(self.model_dir)
        return self._processor

    # ---- the request adapter -------------------------------------------------------------------

    def build_request(self, job: SpeechJobLike) -> tuple[np.ndarray, Sampling]:
        """Prompt `[S, 1 + n_vq]` int64 and sampling for `job`; ValueError on a bad field."""
        return self.build_prompt(job), self.resolve_sampling(job)

    def prime_frames(self, job: SpeechJobLike) -> int:
        """Continuation: the prompt ends with the reference's audio rows; the codec decodes
        them first (audio dropped) so the new audio starts with the reference as left context,
        as upstream's decode of the whole block followed by trimming the prompt part does.
        0 when the profile skips the prime (`codec.prime_continuation: false`)."""
        if job.ref_codes is not None and job.ref_text and self.profile.codec.prime_continuation:
            return int(len(job.ref_codes))
        return 0

    def build_prompt(self, job: SpeechJobLike) -> np.ndarray:
        common = dict(language=job.language, instruction=job.instructions)
        if job.ref_codes is not None and job.ref_text and self.profile.codec.prime_continuation:
            return self.processor.build_prompt(job.text, prompt_codes=job.ref_codes,
                                               prompt_text=job.ref_text, **common)
        if job.ref_codes is not None:
            return self.processor.build_prompt(job.text, reference=[job.ref_codes], **common)
        if job.ref_text:
            raise ValueError("ref_text needs reference audio (ref_codes)")
        return self.processor.build_prompt(job.text, **common)

    def resolve_sampling(self, job: SpeechJobLike) -> Sampling:
        return self._sampling.resolve(job)

    # ---- runners (worker processes) ------------------------------------------------------------

    def make_talker_runner(self, device: str) -> Any:
        from stages.models.local_v15.loader import load_talker_runner

        return load_talker_runner(self.model_dir, self.profile, device)

    def make_codec_runner(self, device: str) -> Any:
        from stages.models.codec.serving import make_codec_runner

        return make_codec_runner(self.codec_dir, self.profile, device, self.n_vq)
