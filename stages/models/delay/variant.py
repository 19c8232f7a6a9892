"""The Delay family as served variants: MOSS-TTS, MOSS-TTSD, MOSS-SoundEffect, MOSS-VoiceGenerator.

All four are `moss_tts_delay` checkpoints with the v1 codec (24 kHz mono). Which one a checkpoint
is: the profile's `model.variant`, else `mossvox_variant` in config.json (written by
`make-checkpoint`), else n_vq 32 means MOSS-TTS; a 16-codebook checkpoint without a name is
ambiguous and refused with a message that says how to name it.

The request adapter (`build_request`, API process) maps an engine-level speech job onto the
variant's rules (`stages.models.delay.adapters`): `input` is the text (SoundEffect: the sound
description), `instructions` the instruction field (VoiceGenerator: required voice description),
`ref_codes` + `extra_ref_codes` the references (TTSD: speaker S1, S2, ... in order), `ref_text`
their transcript (continuation; TTSD: one transcript with [S1]..[S5] tags, or untagged for a
single reference). A rule violation is an `AdapterError` (HTTP 400).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np

from ipc.messages import Sampling
from profiles import Profile
from stages.runtime.checkpoint import read_config
from stages.models.codec.serving import CodecShape, make_codec_runner
from stages.models.delay.adapters import (SAMPLING_DEFAULTS, AdapterError, DelayRequest, build_request,
                                   variant_for_config)
from stages.models.delay.processor import DelayProcessor
from stages.registry import SpeechJobLike, to_wire
from stages.runtime.request_sampling import SamplingResolver

CONFIG_VARIANT_KEY = "mossvox_variant"  # written by make-checkpoint into config.json
DISPLAY_NAMES = {"moss-tts": "moss-tts-delay", "ttsd": "moss-ttsd", "sound-effect": "moss-sound-effect",
                 "voice-generator": "moss-voice-generator"}
_TAGGED = re.compile(r"\[S(\d+)\]")


def delay_variant_name(config: dict, profile: Profile) -> str:
    """The Delay variant of a checkpoint: profile `model.variant`, config.json, or n_vq 32."""
    name = profile.model.variant or config.get(CONFIG_VARIANT_KEY)
    try:
        return variant_for_config(config, name)
    except ValueError as e:
        raise ValueError(f"{e}: set model.variant in the profile (--set model.variant=ttsd) or "
                         f"{CONFIG_VARIANT_KEY!r} in config.json") from None


def talker_options(profile: Profile) -> dict[str, Any]:
    """Runner capacity keywords from the profile's `talker` section (Delay and Realtime runners)."""
    t = profile.talker
    return dict(max_running=t.max_running, kv_block_size=t.kv_block_size, num_kv_blocks=t.kv_blocks,
                kv_memory_fraction=t.kv_memory_fraction, prefill_chunk_tokens=t.prefill_chunk_tokens,
                max_prefill_tokens_per_step=t.max_prefill_tokens_per_step, prefill_interval=t.prefill_interval)


def talker_runner_options(profile: Profile, device: str) -> dict[str, Any]:
    """`talker_options` plus the attention kernel and the backbone graphs (CUDA only) the profile
    asks for (`talker.attention`; `talker.cuda_graphs` and `talker.backbone_graphs`). On CPU,
    "auto" attention keeps the runner's default (the per-sequence reference)."""
    from stages.runtime.attention.backends import make_attention

    t = profile.talker
    cuda = str(device).startswith("cuda")
    attention = make_attention(t.attention, device) if cuda or t.attention != "auto" else None
    return dict(talker_options(profile), attention=attention, cuda_graphs=t.cuda_graphs and t.backbone_graphs and cuda)


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


class DelayVariant:
    """One Delay-family checkpoint with the v1 codec; see the module docstring."""

    def __init__(self, model_dir: Path, profile: Profile, config: dict | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.profile = profile
        self.config = config if config is not None else read_config(model_dir)
        self.variant = delay_variant_name(self.config, profile)
        self.name = DISPLAY_NAMES[self.variant]
        self.n_vq = int(self.config.get("n_vq", 32))
        codec = CodecShape.of(self.model_dir, profile)
        self.codec_dir = codec.codec_dir
        self.sample_rate, self.channels = codec.sample_rate, codec.channels
        self.frame_rate, self.samples_per_frame = codec.frame_rate, codec.samples_per_frame
        self.sampling_defaults = to_wire(SAMPLING_DEFAULTS[self.variant])
        self._sampling = SamplingResolver(self.sampling_defaults, profile)
        self._processor: DelayProcessor | None = None

    @property
    def processor(self) -> DelayProcessor:
        if self._processor is None:
            self._processor = DelayProcessor.from_dir(self.model_dir)
        return self._processor

    # ---- the request adapter -------------------------------------------------------------------

    def build_request(self, job: SpeechJobLike) -> tuple[np.ndarray, Sampling]:
        """Prompt `[S, 1 + n_vq]` int64 (delayed layout) and sampling; AdapterError / ValueError."""
        return build_request(self.processor, self.variant, self.delay_request(job)), self._sampling.resolve(job)

    def delay_request(self, job: SpeechJobLike) -> DelayRequest:
        """The adapter's view of `job`: references in speaker order, one transcript each."""
        refs = [] if job.ref_codes is None else [job.ref_codes]
        refs += list(getattr(job, "extra_ref_codes", None) or ())
        if job.ref_codes is None and refs:
            raise AdapterError("extra reference clips need a first one (ref_codes)")
        if self.variant == "ttsd":
            texts = split_transcripts(job.ref_text, len(refs))
        else:
            texts = [job.ref_text] if job.ref_text else []
        return DelayRequest(text=job.text, instructions=job.instructions, language=job.language,
                            ref_codes=tuple(refs), ref_texts=tuple(texts))

    def warm_up_job(self) -> SpeechJobLike:
        """A short job this variant's adapter accepts (the talker worker's warm-up request)."""
        from stages.workers.talker import WarmUpJob

        fields = {"ttsd": {"text": "[S1] warm up"},
                  "voice-generator": {"instructions": "a calm, clear voice"}}.get(self.variant, {})
        return dataclasses.replace(WarmUpJob(), **fields)

    def prime_frames(self, job: SpeechJobLike) -> int:
        """Frames the codec decodes first as left context: those of `prime_codes`."""
        context = self.prime_codes(job)
        return 0 if context is None else len(context)

    def prime_codes(self, job: SpeechJobLike) -> np.ndarray | None:
        """Continuation (references + `ref_text`): the reference codes `[T, n_vq]` (TTSD: every
        speaker's clip, in order), decoded first so the new audio continues them, as upstream's
        decode of the whole block then trimming the prompt part does. The prompt holds them only
        in the delayed layout, which is not codec input, so they travel after the prompt."""
        if job.ref_codes is None or not job.ref_text:
            return None
        refs = [job.ref_codes, *(getattr(job, "extra_ref_codes", None) or ())]
        return np.concatenate([np.asarray(c, dtype=np.int64) for c in refs])

    # ---- runners (worker processes) ------------------------------------------------------------

    def make_talker_runner(self, device: str) -> Any:
        from stages.models.delay.runner import DelayRunner
        from stages.models.local_v15.loader import resolve_dtype

        dtype = resolve_dtype(self.profile.model.dtype, device)
        tp = self.profile.talker.tensor_parallel
        if tp > 1:  # this process becomes rank 0 of tp ranks on consecutive GPUs
            from stages.workers.tp_ranks import start_delay_tp, tp_devices

            return start_delay_tp(self.model_dir, devices=tp_devices(device, tp), dtype=dtype,
                                  torch_threads=self.profile.talker.torch_threads,
                                  attention=self.profile.talker.attention, **talker_options(self.profile))
        return DelayRunner.from_dir(self.model_dir, device=device, dtype=dtype,
                                    **talker_runner_options(self.profile, device))

    def make_codec_runner(self, device: str) -> Any:
        return make_codec_runner(self.codec_dir, self.profile, device, self.n_vq)
