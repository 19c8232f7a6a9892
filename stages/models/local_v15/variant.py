"""The MOSS-TTS-Local-Transformer-v1.5 variant: request adapter, sampling defaults, runner, checkpoints.

The request adapter (`adapt`, through `build_request`) runs in the API process: it turns a speech
job into the prompt `[S, 1 + n_vq]`, the resolved sampling and, in continuation, the codes the
codec decodes first, so the engine never tokenizes. It uses every optional field: one reference,
its transcript (continuation), instructions and language.
"""

from __future__ import annotations

from speech.job import OPTIONAL_FIELDS, SpeechJob
from speech.sampling import SamplingParams
from stages.models.local_v15.processor import LocalV15Processor
from stages.runtime.talker_runner import TalkerRunner
from stages.variant import AdapterError, CheckpointRecipe, Size, TalkerRequest, Variant


class LocalV15Variant(Variant):
    """MOSS-TTS-Local-Transformer-v1.5 with MOSS-Audio-Tokenizer-v2 (48 kHz stereo at full size)."""

    model_types = ("moss_tts_local",)
    description = "MOSS-TTS-Local-Transformer-v1.5"
    name = "moss-tts-local-v1.5"
    processor_class = LocalV15Processor
    processor: LocalV15Processor
    continues_context = True
    used_fields = frozenset(OPTIONAL_FIELDS)

    @property
    def sampling_defaults(self) -> SamplingParams:  # the model card's, up to the profile's frame cap
        return SamplingParams(max_new_frames=self.profile.model.max_new_frames)

    # ---- the request adapter -------------------------------------------------------------------

    def adapt(self, job: SpeechJob) -> TalkerRequest:
        """Prompt `[S, 1 + n_vq]` int64, sampling and priming for `job`; ValueError on a bad field.

        Continuation (`ref_codes` + `ref_text`): the prompt ends with the reference's audio rows,
        and the codec decodes them first (audio dropped), so the new audio starts with the
        reference as left context, as upstream's decode of the whole block followed by trimming
        the prompt part does. The profile may skip that (`codec.prime_continuation: false`): the
        reference is then a voice-clone reference.

        Context (`job.context_codes` + `context_text`, the audio a stream spoke just before): the
        same continuation with those codes and that transcript, the reference (if any) as the
        voice-clone reference, so a stream's sentences go on in one voice and one prosody."""
        if job.extra_ref_codes:
            raise AdapterError("MOSS-TTS-Local-Transformer takes one reference clip (ref_audio), not several")
        common = dict(language=job.language, instruction=job.instructions)
        sampling = self.resolve_sampling(job)
        if job.context_codes is not None and self.profile.codec.prime_continuation:
            reference = [job.ref_codes] if job.ref_codes is not None else []
            prompt = self.processor.build_prompt(job.text, reference=reference, prompt_codes=job.context_codes,
                                                 prompt_text=job.context_text or "", **common)
            return TalkerRequest(prompt, sampling, prime_codes=prompt[len(prompt) - len(job.context_codes):, 1:])
        if job.ref_codes is not None and job.ref_text and self.profile.codec.prime_continuation:
            prompt = self.processor.build_prompt(job.text, prompt_codes=job.ref_codes,
                                                 prompt_text=job.ref_text, **common)
            return TalkerRequest(prompt, sampling, prime_codes=prompt[len(prompt) - len(job.ref_codes):, 1:])
        if job.ref_codes is not None:
            return TalkerRequest(self.processor.build_prompt(job.text, reference=[job.ref_codes], **common),
                                 sampling)
        if job.ref_text:
            raise ValueError("ref_text needs reference audio (ref_codes)")
        return TalkerRequest(self.processor.build_prompt(job.text, **common), sampling)

    # ---- runners (worker processes) ------------------------------------------------------------

    def make_talker_runner(self, device: str) -> TalkerRunner:
        from stages.models.local_v15.runner import load_talker_runner

        return load_talker_runner(self.model_dir, self.profile, device)

    # ---- developer tools -----------------------------------------------------------------------

    @classmethod
    def checkpoints(cls) -> dict[str, CheckpointRecipe]:
        return {"local-v1.5": CheckpointRecipe(_talker_config, _talker_module, _codec_config, _hub_config)}


def _talker_config(size: Size) -> dict:
    from stages.models.local_v15.config import full_size_config, tiny_config

    return full_size_config() if size == "full" else tiny_config()


def _talker_module(config: dict):
    from stages.models.local_v15.loader import build_talker_module

    return build_talker_module(config)


def _codec_config(size: Size) -> dict:
    from stages.models.codec.config import full_size_v2_config, tiny_v2_config

    return full_size_v2_config() if size == "full" else tiny_v2_config()


def _hub_config(config: dict) -> dict:
    from stages.models.local_v15.hub_keys import with_local_v15_hub_keys

    return with_local_v15_hub_keys(config)
