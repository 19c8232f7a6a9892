"""Direct synthesis, in this process, without workers: text (+ reference clip) -> PCM.

processor -> talker runner -> chunk policy -> codec runner streaming decode, one request at a
time. It is `mossvox synth` until the engine routes that through the worker processes, and the
single-request baseline of `mossvox bench engine`.

Reference audio: decoded with soundfile, prepared for the codec (`stages.models.codec.audio_prep`),
encoded with the codec runner; the variant makes it a voice-clone prompt, or a continuation prompt
when its transcript (`ref_text`) is given. In continuation the variant's request carries prime
codes: the codec slot is first fed them (their audio is dropped), so the decoder starts the new
audio with the reference as its left context, as the engine's codec worker does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from profiles import Profile
from speech.job import SpeechJob
from stages.models.codec.audio_prep import prepare_reference, read_audio
from stages.registry import load_variant
from stages.runtime.chunk_policy import ChunkAccumulator, ChunkSchedule
from stages.workers.placement import resolve_device

log = logging.getLogger(__name__)

RID = 0
AudioSource = str | Path | bytes | tuple[np.ndarray, int]  # file, its bytes, or (wav [C, N], rate)


@dataclass(frozen=True)
class SynthStats:
    """What one synthesis did: frames, why it ended, and its wall-clock timings in seconds."""

    frames: int
    finish_reason: str | None
    prompt_rows: int
    first_chunk_s: float
    total_s: float


def reference_codes(codec: Any, source: AudioSource) -> np.ndarray:
    """Encode a reference clip for the codec: decode, fix channels, resample, normalise, encode."""
    wav, rate = source if isinstance(source, tuple) else read_audio(source)
    prepared = prepare_reference(wav, rate, target_rate=codec.sample_rate, channels=codec.channels)
    return codec.encode([prepared])[0]  # [T, n_vq]


class DirectSynthesizer:
    """One model's talker and codec runners, loaded once, synthesising requests one by one."""

    def __init__(self, model_dir: str | Path, profile: Profile, device: str | None = None) -> None:
        self.device = resolve_device(device or profile.model.device)
        self.variant = load_variant(model_dir, profile)
        self.talker = self.variant.make_talker_runner(self.device)
        self.codec = self.variant.make_codec_runner(self.device)
        c = profile.chunking
        self.schedule = ChunkSchedule(c.initial_chunk_frames, tuple(c.ramp), c.chunk_frames)

    @property
    def sample_rate(self) -> int:
        return self.variant.sample_rate

    def synthesize(
        self,
        text: str,
        *,
        ref_audio: AudioSource | None = None,
        ref_text: str | None = None,
        language: str | None = None,
        instructions: str | None = None,
        seed: int | None = None,
        sampling: dict[str, Any] | None = None,
        forced_frames: int | None = None,
        on_chunk: Callable[[np.ndarray], None] | None = None,
    ) -> tuple[np.ndarray, SynthStats]:
        """PCM float32 `[channels, samples]` at `sample_rate`, and what it took.

        instructions: the variant's instruction field (v1.5: the template's "- Instruction:").
        on_chunk: called with each decoded chunk `[channels, n]` as soon as it exists.
        """
        start = time.perf_counter()
        codes = reference_codes(self.codec, ref_audio) if ref_audio is not None else None
        if ref_text and codes is None:
            raise ValueError("ref_text needs reference audio")
        overrides = dict(sampling or {})
        if seed is not None:
            overrides["seed"] = seed
        job = SpeechJob(text=text, language=language, instructions=instructions, ref_codes=codes,
                        ref_text=ref_text or None, sampling=overrides, forced_frames=forced_frames)
        request = self.variant.build_request(job)
        prompt, params = request.prompt, request.sampling
        chunks: list[np.ndarray] = []
        first_chunk_s = 0.0

        def emit(chunk_codes: np.ndarray) -> None:
            nonlocal first_chunk_s
            if chunk_codes.shape[0] == 0:
                return
            pcm = self.codec.decode([(RID, chunk_codes)])[0]  # [channels, T * samples_per_frame]
            if not chunks:
                first_chunk_s = time.perf_counter() - start
            chunks.append(pcm)
            if on_chunk is not None:
                on_chunk(pcm)

        self.talker.add(RID, prompt, params)
        self.codec.open(RID)
        frames, reason = 0, None
        try:
            if request.prime_codes is not None:  # left context of the continuation; audio dropped
                self.codec.decode([(RID, request.prime_codes)])
            accumulator = ChunkAccumulator(self.schedule, self.variant.n_vq)
            finished = False
            # every step prefills at least one prompt row or emits a frame: a bound, not a timeout
            step_budget = prompt.shape[0] + params.max_new_frames + (params.forced_frames or 0) + 16
            while not finished:
                step_budget -= 1
                if step_budget < 0:
                    raise RuntimeError(f"talker made no progress: {frames} frames after the step budget")
                for event in self.talker.step():
                    if event.codes is not None:
                        frames += 1
                        chunk = accumulator.push(event.codes)
                        if chunk is not None:
                            emit(chunk)
                    if event.finished:
                        finished, reason = True, event.reason
            emit(accumulator.finish())
        finally:
            self.talker.remove(RID)
            self.codec.close(RID)
        channels = self.variant.channels
        pcm = np.concatenate(chunks, axis=1) if chunks else np.zeros((channels, 0), dtype=np.float32)
        stats = SynthStats(frames, reason, int(prompt.shape[0]), first_chunk_s, time.perf_counter() - start)
        return pcm, stats


def synthesize(model_dir: str | Path, text: str, *, profile: Profile | None = None, **kwargs: Any) -> np.ndarray:
    """One-shot `DirectSynthesizer(model_dir, profile).synthesize(text, ...)`: PCM `[channels, samples]`.

    profile: default the shipped `cpu` profile (CPU, length forced from the text).
    """
    if profile is None:
        from profiles import load_profile

        profile = load_profile("cpu", [])
    pcm, _ = DirectSynthesizer(model_dir, profile).synthesize(text, **kwargs)
    return pcm
