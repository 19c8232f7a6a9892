"""The Delay family as served variants: MOSS-TTS, MOSS-TTSD, MOSS-SoundEffect, MOSS-VoiceGenerator.

All four are `moss_tts_delay` checkpoints with the v1 codec (24 kHz mono). Which one a checkpoint
is: the profile's `model.variant`, else `mossvox_variant` in config.json (written by
`make-checkpoint`), else n_vq 32 means MOSS-TTS; a 16-codebook checkpoint without a name is
ambiguous and refused with a message that says how to name it.

The request adapter (`adapt`, through `build_request`, API process) maps an engine-level speech
job onto the variant's rules (`stages.models.delay.adapters`): `input` is the text (SoundEffect:
the sound description; TTSD: untagged text is spoken by [S1]), `instructions` the instruction
field (VoiceGenerator: required voice description), `ref_codes` + `extra_ref_codes` the
references (TTSD: speaker S1, S2, ... in order), `ref_text` their transcript (continuation;
TTSD: one transcript with [S1]..[S5] tags, or untagged for a single reference). The optional
fields a variant does not use (`adapters.USED_FIELDS`: TTSD has no instruction field,
SoundEffect uses none, VoiceGenerator no reference) are cleared before the adapter runs. A rule
violation is an `AdapterError` (HTTP 400).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from profiles import Profile
from speech.job import SpeechJob
from stages.models.delay.adapters import (DEFAULT_SPEAKER, SAMPLING_DEFAULTS, USED_FIELDS, DelayRequest, build_request,
                                          variant_for_config)
from stages.models.delay.processor import DelayProcessor
from stages.runtime.talker_runner import TalkerRunner
from stages.variant import AdapterError, CheckpointRecipe, Size, TalkerRequest, UnknownModel, Variant

CONFIG_VARIANT_KEY = "mossvox_variant"  # written by make-checkpoint into config.json
DISPLAY_NAMES = {"moss-tts": "moss-tts-delay", "ttsd": "moss-ttsd", "sound-effect": "moss-sound-effect",
                 "voice-generator": "moss-voice-generator"}
CHECKPOINT_NAMES = {"delay": "moss-tts", "ttsd": "ttsd", "sound-effect": "sound-effect",
                    "voice-generator": "voice-generator"}  # make-checkpoint name -> variant
_TAGGED = re.compile(r"\[S(\d+)\]")


def delay_variant_name(config: dict, profile: Profile) -> str:
    """The Delay variant of a checkpoint: profile `model.variant`, config.json, or n_vq 32."""
    name = profile.model.variant or config.get(CONFIG_VARIANT_KEY)
    try:
        return variant_for_config(config, name)
    except ValueError as e:
        raise ValueError(f"{e}: set model.variant in the profile (--set model.variant=ttsd) or "
                         f"{CONFIG_VARIANT_KEY!r} in config.json") from None


def split_transcripts(ref_text: str | None, references: int) -> list[str | None]:
    """Per-speaker transcripts of `references` clips from one `ref_text`.

    "[S1] hi there [S2] hello" -> ["[S1] hi there", "[S2] hello"]; an untagged text belongs to S1
    (one reference). A reference without its transcript gets None (the adapter names it)."""
    if not ref_text or not ref_text.strip():
        return [None] * references
    tags = _TAGGED.findall(ref_text)
    if not tags:
        if references > 1:
            raise AdapterError(f"{references} reference clips need one transcript each: tag ref_text "
                               f"by speaker, e.g. '[S1] first clip's words [S2] second clip's words'")
        return [ref_text.strip()]
    texts: list[str | None] = [None] * max(references, max(int(t) for t in tags))
    for part in re.split(r"(?=\[S\d+\])", ref_text):
        m = _TAGGED.match(part)
        if m is None:
            if part.strip():
                raise AdapterError("ref_text must start with a speaker tag such as [S1] when it is tagged")
            continue
        i = int(m.group(1)) - 1
        if not 0 <= i < len(texts) or texts[i] is not None:
            raise AdapterError(f"ref_text: speaker tag [S{i + 1}] is repeated or out of range")
        texts[i] = part.strip()
    if len(texts) > references:
        raise AdapterError(f"ref_text has transcripts for {len(texts)} speakers but {references} "
                           f"reference clip(s) were sent")
    return texts


class DelayVariant(Variant):
    """One Delay-family checkpoint with the v1 codec; see the module docstring."""

    model_types = ("moss_tts_delay",)
    description = "MOSS-TTS / TTSD / SoundEffect / VoiceGenerator"
    tensor_parallel = True
    named_variants = tuple(DISPLAY_NAMES)
    processor_class = DelayProcessor
    processor: DelayProcessor

    def __init__(self, model_dir: str | Path, profile: Profile, config: dict | None = None) -> None:
        super().__init__(model_dir, profile, config)
        self.variant = delay_variant_name(self.config, profile)
        self.name = DISPLAY_NAMES[self.variant]
        self.sampling_defaults = SAMPLING_DEFAULTS[self.variant]
        self.used_fields = USED_FIELDS[self.variant]

    @classmethod
    def check(cls, model_dir: Path, config: dict, profile: Profile) -> None:
        super().check(model_dir, config, profile)
        if "local_num_layers" in config:
            raise UnknownModel(f"{model_dir}/config.json is MOSS-TTS-Local-Transformer v1 (moss_tts_delay "
                               f"with local_num_layers), which is not served; v1.5 (moss_tts_local) is")

    def codebooks(self) -> int:
        return int(self.config.get("n_vq", 32))

    # ---- the request adapter -------------------------------------------------------------------

    def adapt(self, job: SpeechJob) -> TalkerRequest:
        """Prompt `[S, 1 + n_vq]` int64 (delayed layout), sampling and priming; AdapterError / ValueError.

        Continuation (references + `ref_text`): the codec first decodes the reference codes
        `[T, n_vq]` (TTSD: every speaker's clip, in order) so the new audio continues them, as
        upstream's decode of the whole block then trimming the prompt part does. The prompt holds
        them only in the delayed layout, which is not codec input, so they are the prime codes.
        The profile may skip that prime (`codec.prime_continuation: false`): the prompt is the
        same, the first frames are decoded without the reference as left context."""
        prompt = build_request(self.processor, self.variant, self.delay_request(job))
        return TalkerRequest(prompt, self.resolve_sampling(job), self._prime_codes(job))

    def delay_request(self, job: SpeechJob) -> DelayRequest:
        """The adapter's view of `job`: references in speaker order, one transcript each."""
        refs = [] if job.ref_codes is None else [job.ref_codes]
        refs += list(job.extra_ref_codes or ())
        if job.ref_codes is None and refs:
            raise AdapterError("extra reference clips need a first one (ref_codes)")
        if self.variant == "ttsd":
            texts = split_transcripts(job.ref_text, len(refs))
        else:
            texts = [job.ref_text] if job.ref_text else []
        return DelayRequest(text=job.text, instructions=job.instructions, language=job.language,
                            ref_codes=tuple(refs), ref_texts=tuple(texts))

    def _prime_codes(self, job: SpeechJob) -> np.ndarray | None:
        if job.ref_codes is None or not job.ref_text or not self.profile.codec.prime_continuation:
            return None
        refs = [job.ref_codes, *(job.extra_ref_codes or ())]
        return np.concatenate([np.asarray(c, dtype=np.int64) for c in refs])

    def default_speaker(self, text: str) -> str | None:
        """TTSD: [S1] speaks text without speaker tags (with the first reference as its voice)."""
        return DEFAULT_SPEAKER if self.variant == "ttsd" and not _TAGGED.search(text) else None

    def warm_up_job(self) -> SpeechJob:
        """The plain warm-up job, with what this variant's rules need (VoiceGenerator: a voice
        description)."""
        job = super().warm_up_job()
        if self.variant == "voice-generator":
            job.instructions = "a calm, clear voice"
        return job

    # ---- runners (worker processes) ------------------------------------------------------------

    def make_talker_runner(self, device: str) -> TalkerRunner:
        from stages.models.delay.runner import DelayRunner
        from stages.runtime.runner_options import resolve_dtype, talker_options, talker_runner_options

        dtype = resolve_dtype(self.profile.model.dtype, device)
        t = self.profile.talker
        if t.tensor_parallel > 1:  # this process becomes rank 0 of tp ranks on consecutive GPUs
            from stages.models.delay.tp_runner import start_delay_tp
            from stages.workers.tp_ranks import tp_devices

            return start_delay_tp(self.model_dir, devices=tp_devices(device, t.tensor_parallel), dtype=dtype,
                                  torch_threads=t.torch_threads, attention=t.attention,
                                  **talker_options(self.profile))
        return DelayRunner.from_dir(self.model_dir, device=device, dtype=dtype,
                                    **talker_runner_options(self.profile, device, backbone_graphs=True))

    # ---- developer tools -----------------------------------------------------------------------

    @classmethod
    def checkpoints(cls) -> dict[str, CheckpointRecipe]:
        """delay (MOSS-TTS, 8B, n_vq 32), ttsd and sound-effect (8B, n_vq 16), voice-generator
        (1.7B, n_vq 16); each with the v1 codec, and its name in config.json (16-codebook configs
        cannot tell TTSD, SoundEffect and VoiceGenerator apart)."""
        return {name: CheckpointRecipe(_talker_config(variant), _talker_module, _codec_config,
                                       _named_config(variant))
                for name, variant in CHECKPOINT_NAMES.items()}


def _talker_config(variant: str) -> Any:
    def config(size: Size) -> dict:
        from stages.models.delay.config import VARIANT_N_VQ, full_size_config, tiny_config

        return full_size_config(variant) if size == "full" else tiny_config(n_vq=VARIANT_N_VQ[variant])

    return config


def _talker_module(config: dict):
    from stages.models.delay.config import DelayConfig
    from stages.models.delay.model import DelayModel

    return DelayModel(DelayConfig.from_dict(config))


def _codec_config(size: Size) -> dict:
    from stages.models.codec.config import full_size_v1_config, tiny_v1_config

    return full_size_v1_config() if size == "full" else tiny_v1_config()


def _named_config(variant: str) -> Any:
    return lambda config: {**config, CONFIG_VARIANT_KEY: variant}
