"""A variant's audio tokenizer: where it lives, its output shape, and its `CodecRunner`.

Every checkpoint keeps its codec in `<model>/audio_tokenizer/` unless the profile names
`model.codec_path`. Reading the shape needs only `config.json`; loading the runner needs the
weights (worker processes only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profiles import Profile
from stages.checkpoint import read_config
from stages.codec.config import CodecConfig

CODEC_SUBDIR = "audio_tokenizer"


@dataclass(frozen=True)
class CodecShape:
    """What the API and engine need to know about the codec's PCM (no weights read)."""

    codec_dir: Path
    sample_rate: int
    channels: int
    frame_rate: float
    samples_per_frame: int  # per channel

    @classmethod
    def of(cls, model_dir: Path, profile: Profile) -> CodecShape:
        codec_dir = Path(profile.model.codec_path or Path(model_dir) / CODEC_SUBDIR)
        cfg = CodecConfig.from_json(read_config(codec_dir))
        return cls(codec_dir, cfg.sampling_rate, cfg.channels, cfg.frame_rate, cfg.downsample_rate)


def make_codec_runner(codec_dir: Path, profile: Profile, device: str, n_vq: int) -> Any:
    """The `CodecRunner` over the first `n_vq` quantizers, slots and ring headroom from the profile."""
    from stages.codec.loader import load_codec
    from stages.codec_runner import CodecRunner
    from stages.local_v15.loader import resolve_dtype

    c = profile.chunking
    return CodecRunner(load_codec(codec_dir, device, resolve_dtype(profile.model.dtype, device)), n_vq=n_vq,
                       max_slots=profile.codec.max_slots,
                       max_chunk_frames=max(c.chunk_frames, c.initial_chunk_frames, *c.ramp))
