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
from stages.models.codec.config import CodecConfig
from stages.runtime.checkpoint import read_config

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


def chunk_lengths(profile: Profile) -> tuple[int, ...]:
    """The chunk sizes of the profile's schedule, in frames: initial, ramp, steady (distinct, in order)."""
    c = profile.chunking
    return tuple(dict.fromkeys((c.initial_chunk_frames, *c.ramp, c.chunk_frames)))


def encode_batch_samples(profile: Profile, sample_rate: int) -> int | None:
    """`codec.encode_batch_seconds` in samples a channel (None when unset)."""
    seconds = profile.codec.encode_batch_seconds
    return None if seconds is None else int(seconds * sample_rate)


def make_codec_runner(codec_dir: Path, profile: Profile, device: str, n_vq: int, dtype: Any = None) -> Any:
    """The `CodecRunner` over the first `n_vq` quantizers: slots, ring headroom (the longest chunk of
    the schedule; a longer one, e.g. a per-request first chunk or reference priming codes, decodes
    in pieces), CUDA graphs (`codec.cuda_graphs` for decode, `codec.encode_graphs` for reference
    encoding), replays side by side (`codec.decode_lanes`), chunks cut into shorter replays
    (`codec.split_chunks`), compiled layers (`codec.compile`, or the encoder's alone:
    `codec.compile_encoder`) and attention over the rings in place
    (`codec.ring_attention`, up to `codec.ring_attention_max_frames`; `codec.fused_ring_writes`,
    `codec.fused_norms`, `codec.fused_attention`), the decoder's GELU in its first matmul
    (`codec.gelu_epilogue`), reference encodes through the streaming kernels (`codec.fused_encoder`),
    CUDA devices only, from the profile; each chunk decoded in a call of its own with
    `talker.batch_invariant` (`decode_alone`).
    dtype: None = `model.dtype` resolved for the device."""
    from stages.models.codec.loader import load_codec
    from stages.models.codec.runner import CodecRunner
    from stages.runtime.runner_options import resolve_dtype

    dtype = resolve_dtype(profile.model.dtype, device) if dtype is None else dtype
    model = load_codec(codec_dir, device, dtype)
    if (profile.codec.compile or profile.codec.compile_encoder) and str(device).startswith("cuda"):
        model.compile_layers(decoder=profile.codec.compile)
    if profile.codec.ring_attention and str(device).startswith("cuda"):
        model.use_ring_attention(profile.codec.ring_attention_max_frames,
                                 fused_writes=profile.codec.fused_ring_writes,
                                 fused_norms=profile.codec.fused_norms,
                                 fused_attention=profile.codec.fused_attention)
    model.use_gelu_epilogue(profile.codec.gelu_epilogue)
    model.use_fused_encoder(profile.codec.fused_encoder and str(device).startswith("cuda"))
    return CodecRunner(model, n_vq=n_vq,
                       max_slots=profile.codec.max_slots, max_chunk_frames=max(chunk_lengths(profile)),
                       cuda_graphs=profile.codec.cuda_graphs and str(device).startswith("cuda"),
                       encode_graphs=profile.codec.encode_graphs and str(device).startswith("cuda"),
                       encode_batch=profile.codec.encode_batch,
                       encode_batch_samples=encode_batch_samples(profile, model.cfg.sampling_rate),
                       decode_lanes=profile.codec.decode_lanes,
                       split_chunks=profile.codec.split_chunks, decode_alone=profile.talker.batch_invariant)
