"""MOSS-Audio-Tokenizer configuration: both `config.json` layouts -> one frozen `CodecConfig`.

v1 (24 kHz mono, `model_type: "speech_tokenizer"`) and v2 (48 kHz stereo, channel-interleaved,
`model_type: "moss-audio-tokenizer"`) share one architecture (docs/model_facts.md, "Codec"). Their differences are
config-driven here:

| | v1 | v2 |
|---|---|---|
| transformer in/out projections | Identity when the dims are equal | always a Linear |
| attention context (positions) | `int(rate * duration)` | `int(round(rate * duration))` |
| per-stage `context_duration` | accepted (falls back to the global one) | accepted |
| channels | 1 | `number_channels`, interleaved L,R,L,R into one stream |

A v2 config is recognised by its channel keys (`number_channels`, `enable_channel_interleave`);
everything else parses as v1 (dtype keys such as `codec_weight_dtype` may appear in either).

`tiny_v1_config()` / `tiny_v2_config()` / `full_size_v1_config()` / `full_size_v2_config()` return
`config.json` dicts (the real layouts) for random-weight checkpoints.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

V2_ONLY_KEYS = ("number_channels", "enable_channel_interleave")


@dataclass(frozen=True)
class PatchStage:
    """Weightless reshape between time and channels by `patch_size` (down in the encoder, up in the decoder)."""

    patch_size: int


@dataclass(frozen=True)
class TransformerStage:
    """One `ProjectedTransformer`: input_proj -> causal windowed RoPE layers -> output_proj.

    `rate` is the stage's positions per second in the (interleaved) stream; `tokens_per_frame` its
    positions per 12.5 Hz code frame; `context` the attention window in positions.
    """

    input_dim: int
    output_dim: int
    d_model: int
    num_heads: int
    num_layers: int
    dim_feedforward: int
    max_period: float
    context: int
    rate: float
    tokens_per_frame: int
    project_always: bool  # v2: projections exist even when dims are equal

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


Stage = PatchStage | TransformerStage


@dataclass(frozen=True)
class QuantizerConfig:
    """Residual LFQ: input_proj (input_dim -> rvq_dim), num_quantizers stages, output_proj (rvq_dim -> output_dim)."""

    input_dim: int
    rvq_dim: int
    output_dim: int
    num_quantizers: int
    codebook_size: int
    codebook_dim: int


@dataclass(frozen=True)
class CodecConfig:
    """A parsed codec config. `encoder`/`decoder` index like the checkpoint's ModuleLists."""

    version: Literal["v1", "v2"]
    sampling_rate: int
    downsample_rate: int  # samples per code frame, per channel
    channels: int
    interleave: bool
    context_duration: float
    encoder: tuple[Stage, ...]
    decoder: tuple[Stage, ...]
    quantizer: QuantizerConfig

    @property
    def frame_rate(self) -> float:
        return self.sampling_rate / self.downsample_rate

    @property
    def interleave_factor(self) -> int:
        return self.channels if (self.interleave and self.channels > 1) else 1

    @property
    def stream_hop(self) -> int:
        """Samples of the (interleaved) single stream per code frame."""
        return self.downsample_rate * self.interleave_factor

    @classmethod
    def from_json(cls, cfg: dict) -> CodecConfig:
        """Parse a codec `config.json` (v1 or v2 layout); raises ValueError naming the bad key."""
        version: Literal["v1", "v2"] = "v2" if any(k in cfg for k in V2_ONLY_KEYS) else "v1"
        sampling_rate = int(cfg.get("sampling_rate", cfg.get("sample_rate", 0)))
        downsample_rate = int(cfg["downsample_rate"])
        channels = int(cfg.get("number_channels", cfg.get("num_channels", 1)))
        interleave = bool(cfg.get("enable_channel_interleave", True)) if version == "v2" else False
        if channels > 1 and not interleave:
            raise ValueError("number_channels > 1 needs enable_channel_interleave: true")
        duration = float(cfg["causal_transformer_context_duration"])
        frame_rate = sampling_rate / downsample_rate
        factor = channels if interleave and channels > 1 else 1

        rate = float(sampling_rate * factor)
        encoder = []
        for i, kw in enumerate(cfg["encoder_kwargs"]):
            stage = _parse_stage(kw, f"encoder_kwargs[{i}]", version, rate, frame_rate, duration)
            encoder.append(stage)
            if isinstance(stage, PatchStage):
                rate /= stage.patch_size
        if abs(rate - frame_rate) > 1e-6:
            raise ValueError(f"encoder_kwargs: encoder ends at {rate} Hz, expected the frame rate {frame_rate}")
        decoder = []
        for i, kw in enumerate(cfg["decoder_kwargs"]):
            stage = _parse_stage(kw, f"decoder_kwargs[{i}]", version, rate, frame_rate, duration)
            decoder.append(stage)
            if isinstance(stage, PatchStage):
                rate *= stage.patch_size
        if round(rate) != round(sampling_rate * factor):
            raise ValueError(f"decoder_kwargs: decoder ends at {rate} Hz, expected {sampling_rate * factor}")

        qkw = dict(cfg["quantizer_kwargs"])
        qtype = qkw.get("quantizer_type", cfg.get("quantizer_type", "rlfq"))
        if qtype not in ("rlfq", "random_prefix_rlfq"):
            raise ValueError(f"quantizer_kwargs.quantizer_type: only rlfq is supported, got {qtype!r}")
        input_dim = int(qkw.get("input_dim", cfg.get("code_dim", 0)))
        quantizer = QuantizerConfig(
            input_dim=input_dim,
            rvq_dim=int(qkw.get("rvq_dim") or input_dim),
            output_dim=int(qkw.get("output_dim") or input_dim),
            num_quantizers=int(qkw["num_quantizers"]),
            codebook_size=int(qkw["codebook_size"]),
            codebook_dim=int(qkw["codebook_dim"]),
        )
        return cls(version, sampling_rate, downsample_rate, channels, interleave, duration,
                   tuple(encoder), tuple(decoder), quantizer)


def _parse_stage(kw: dict, where: str, version: str, rate: float, frame_rate: float, duration: float) -> Stage:
    kind = kw.get("module_type")
    if kind == "PatchedPretransform":
        return PatchStage(int(kw["patch_size"]))
    if kind != "Transformer":
        raise ValueError(f"{where}.module_type: unknown {kind!r}")
    for key, allowed in (("norm", "layer_norm"), ("gating", "none"), ("positional_embedding", "rope")):
        if kw.get(key, allowed) != allowed:
            raise ValueError(f"{where}.{key}: only {allowed!r} is supported, got {kw[key]!r}")
    if not kw.get("causal", True):
        raise ValueError(f"{where}.causal: only causal transformers are supported")
    if kw.get("layer_scale", 0.01) is None:
        raise ValueError(f"{where}.layer_scale: null (no LayerScale) is not supported")
    stage_duration = float(kw.get("context_duration", duration))
    context = int(round(rate * stage_duration)) if version == "v2" else int(rate * stage_duration)
    d_model, num_heads = int(kw["d_model"]), int(kw["num_heads"])
    if d_model % num_heads or (d_model // num_heads) % 2:
        raise ValueError(f"{where}: d_model {d_model} / num_heads {num_heads} must give an even head_dim")
    return TransformerStage(
        input_dim=int(kw["input_dimension"]),
        output_dim=int(kw["output_dimension"]),
        d_model=d_model,
        num_heads=num_heads,
        num_layers=int(kw["num_layers"]),
        dim_feedforward=int(kw["dim_feedforward"]),
        max_period=float(kw.get("max_period", 10000)),
        context=context,
        rate=rate,
        tokens_per_frame=max(1, int(round(rate / frame_rate))),
        project_always=version == "v2",
    )


# ---------------------------------------------------------------- config.json builders

def _tf(inp: int, out: int, d: int, heads: int, layers: int, ff: int, duration: float | None = None) -> dict:
    kw = {
        "causal": True, "conv_layout": True, "d_model": d, "dim_feedforward": ff, "gating": "none",
        "input_dimension": inp, "layer_scale": 0.01, "max_period": 10000, "module_type": "Transformer",
        "norm": "layer_norm", "num_heads": heads, "num_layers": layers, "output_dimension": out,
        "positional_embedding": "rope",
    }
    if duration is not None:
        kw["context_duration"] = duration
    return kw


def _patch(size: int) -> dict:
    return {"module_type": "PatchedPretransform", "patch_size": size}


def _quantizer(code_dim: int, rvq_dim: int, num_quantizers: int, codebook_dim: int = 8) -> dict:
    return {"codebook_dim": codebook_dim, "codebook_size": 1024, "input_dim": code_dim,
            "num_quantizers": num_quantizers, "output_dim": code_dim, "quantizer_type": "rlfq",
            "rvq_dim": rvq_dim}


def _v2_dict(encoder: list, decoder: list, quantizer: dict, duration: float) -> dict:
    return {
        "architectures": ["MossAudioTokenizerModel"],
        "model_type": "moss-audio-tokenizer",
        "attention_implementation": "sdpa",
        "causal_transformer_context_duration": duration,
        "codec_weight_dtype": "fp32",
        "compute_dtype": "fp32",
        "downsample_rate": 3840,
        "enable_channel_interleave": True,
        "number_channels": 2,
        "sampling_rate": 48000,
        "sample_rate": 48000,
        "encoder_kwargs": encoder,
        "decoder_kwargs": decoder,
        "quantizer_type": "rlfq",
        "quantizer_kwargs": quantizer,
        "version": None,
    }


def _v1_dict(encoder: list, decoder: list, quantizer: dict, duration: float) -> dict:
    return {
        "architectures": ["MossAudioTokenizerModel"],
        "model_type": "speech_tokenizer",
        "causal_transformer_context_duration": duration,
        "code_dim": quantizer["input_dim"],
        "downsample_rate": 1920,
        "sampling_rate": 24000,
        "sample_rate": 24000,
        "encoder_kwargs": encoder,
        "decoder_kwargs": decoder,
        "reversed_decoder_kwargs": copy.deepcopy(encoder),
        "quantizer_type": "rlfq",
        "quantizer_kwargs": quantizer,
        "version": "4.26.1.a",
    }


def full_size_v2_config() -> dict:
    """MOSS-Audio-Tokenizer-v2 at real size (docs/model_facts.md, "Codec"): ~2.12 B parameters."""
    narrow = dict(d=768, heads=12, layers=12, ff=3072)
    wide = dict(d=1280, heads=20, layers=32, ff=5120)
    encoder = [
        _patch(240), _tf(240, 384, **narrow, duration=1.0),
        _patch(2), _tf(768, 384, **narrow, duration=2.0),
        _patch(2), _tf(768, 384, **narrow, duration=4.0),
        _patch(2), _tf(768, 384, **narrow, duration=8.0),
        _patch(2), _tf(768, 640, **narrow, duration=10.0),
        _patch(2), _tf(1280, 768, **wide, duration=10.0),
    ]
    decoder = [
        _tf(768, 1280, **wide, duration=10.0), _patch(2),
        _tf(640, 768, **narrow, duration=10.0), _patch(2),
        _tf(384, 768, **narrow, duration=8.0), _patch(2),
        _tf(384, 768, **narrow, duration=4.0), _patch(2),
        _tf(384, 768, **narrow, duration=2.0), _patch(2),
        _tf(384, 240, **narrow, duration=1.0), _patch(240),
    ]
    return _v2_dict(encoder, decoder, _quantizer(768, 512, 32), duration=1.0)


def tiny_v2_config() -> dict:
    """The golden tiny v2 layout (six stages a side, d 32/48, 2 layers, 1.28 s context), 16 x 1024 codes."""
    n = dict(d=32, heads=2, layers=2, ff=128)
    w = dict(d=48, heads=3, layers=2, ff=192)
    encoder = [_patch(240), _tf(240, 16, **n)]
    for _ in range(3):
        encoder += [_patch(2), _tf(32, 16, **n)]
    encoder += [_patch(2), _tf(32, 24, **n), _patch(2), _tf(48, 32, **w)]
    decoder = [_tf(32, 48, **w), _patch(2), _tf(24, 32, **n), _patch(2)]
    for _ in range(3):
        decoder += [_tf(16, 32, **n), _patch(2)]
    decoder += [_tf(16, 240, **n), _patch(240)]
    return _v2_dict(encoder, decoder, _quantizer(32, 16, 16), duration=1.28)


def full_size_v1_config() -> dict:
    """MOSS-Audio-Tokenizer (v1) at real size (docs/model_facts.md, "Codec"): ~1.78 B parameters."""
    narrow = dict(d=768, heads=12, layers=12, ff=3072)
    wide = dict(d=1280, heads=20, layers=32, ff=5120)
    encoder = [
        _patch(240), _tf(240, 384, **narrow), _patch(2), _tf(768, 384, **narrow),
        _patch(2), _tf(768, 640, **narrow), _patch(2), _tf(1280, 768, **wide),
    ]
    decoder = [
        _tf(768, 1280, **wide), _patch(2), _tf(640, 768, **narrow), _patch(2),
        _tf(384, 768, **narrow), _patch(2), _tf(384, 240, **narrow), _patch(240),
    ]
    return _v1_dict(encoder, decoder, _quantizer(768, 512, 32), duration=10.0)


def tiny_v1_config() -> dict:
    """The golden tiny v1 layout (d 32/48, 2 layers, 1.28 s context), 32 x 1024 codes."""
    n = dict(d=32, heads=2, layers=2, ff=128)
    w = dict(d=48, heads=3, layers=2, ff=192)
    encoder = [
        _patch(240), _tf(240, 16, **n), _patch(2), _tf(32, 16, **n),
        _patch(2), _tf(32, 24, **n), _patch(2), _tf(48, 32, **w),
    ]
    decoder = [
        _tf(32, 48, **w), _patch(2), _tf(24, 32, **n), _patch(2),
        _tf(16, 32, **n), _patch(2), _tf(16, 240, **n), _patch(240),
    ]
    return _v1_dict(encoder, decoder, _quantizer(32, 16, 32), duration=1.28)
