"""MOSS-TTS-Realtime as a served variant: 16 codebooks, v1 codec (24 kHz mono), streaming from the
first frame.

The request adapter: `input` is the text to speak; an optional reference (`ref_codes`, one clip)
becomes the voice-timbre context block. Its text may also arrive while it speaks
(`open_text_stream`), as the model was built for. Realtime has no continuation mode, instruction or
language field, so the only optional field it uses is the reference: `ref_text`, `instructions`
and `language` are ignored (and reported by the API), for whole texts and text streams alike.
Several references are wrong rather than unused: an `AdapterError` (HTTP 400). Sampling defaults:
upstream's (docs/model_facts.md, "Realtime").
"""

from __future__ import annotations

from speech.job import SpeechJob
from speech.sampling import SamplingParams
from stages.models.realtime.config import RealtimeConfig
from stages.models.realtime.processor import RealtimeProcessor
from stages.runtime.talker_runner import TalkerRunner
from stages.variant import AdapterError, CheckpointRecipe, Size, TalkerRequest, TextStream, Variant

# upstream inferencer defaults; max_length 5000 as infer.py (the class default is 1000)
SAMPLING_DEFAULTS = SamplingParams(temperature=0.8, top_p=0.6, top_k=30, repetition_penalty=1.1,
                                   max_new_frames=5000)


class RealtimeVariant(Variant):
    """One MOSS-TTS-Realtime checkpoint; see the module docstring."""

    model_types = ("moss_tts_realtime",)
    description = "MOSS-TTS-Realtime"
    name = "moss-tts-realtime"
    sampling_defaults = SAMPLING_DEFAULTS
    processor_class = RealtimeProcessor
    processor: RealtimeProcessor
    takes_text_while_speaking = True
    used_fields = frozenset({"reference"})

    def codebooks(self) -> int:
        return RealtimeConfig.from_dict(self.config).rvq

    def adapt(self, job: SpeechJob) -> TalkerRequest:
        """Prompt (prefill rows, then one row per text token still to stream) and sampling."""
        self._check_references(job)
        if not job.text or not job.text.strip():
            raise AdapterError("input text is required")
        try:
            prompt = self.processor.build_prompt(job.text, reference=job.ref_codes)
        except ValueError as e:  # bad reference codes, text that tokenizes to nothing
            raise AdapterError(str(e)) from None
        return TalkerRequest(prompt, self.resolve_sampling(job))  # the reference is voice context, no prime

    def open_text_stream(self, job: SpeechJob) -> TextStream:
        """Text while it speaks (`stages.models.realtime.text_stream`): the request starts once its
        first 12 tokens are there, later tokens are fed to it as they come. The optional fields it
        does not use are cleared first, as `build_request` clears them for whole texts."""
        from stages.models.realtime.text_stream import RealtimeTextStream

        job = self.without_ignored(job)
        self._check_references(job)
        return RealtimeTextStream(self, job)

    @staticmethod
    def _check_references(job: SpeechJob) -> None:
        if job.extra_ref_codes:
            raise AdapterError("MOSS-TTS-Realtime takes one reference clip (ref_audio), not several")

    def make_talker_runner(self, device: str) -> TalkerRunner:
        from stages.models.realtime.runner import RealtimeRunner
        from stages.runtime.runner_options import resolve_dtype, talker_runner_options

        return RealtimeRunner.from_dir(self.model_dir, device=device,
                                       dtype=resolve_dtype(self.profile.model.dtype, device),
                                       **talker_runner_options(self.profile, device, backbone_graphs=True))

    @classmethod
    def checkpoints(cls) -> dict[str, CheckpointRecipe]:
        """realtime: MOSS-TTS-Realtime (1.7B, 16 codebooks) with the v1 codec."""
        return {"realtime": CheckpointRecipe(_talker_config, _talker_module, _codec_config)}


def _talker_config(size: Size) -> dict:
    from stages.models.realtime.config import full_size_config, tiny_config

    return full_size_config() if size == "full" else tiny_config()


def _talker_module(config: dict):
    from stages.models.realtime.model import RealtimeModel

    return RealtimeModel(RealtimeConfig.from_dict(config))


def _codec_config(size: Size) -> dict:
    from stages.models.codec.config import full_size_v1_config, tiny_v1_config

    return full_size_v1_config() if size == "full" else tiny_v1_config()
