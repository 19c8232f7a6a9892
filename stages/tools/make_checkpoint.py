"""Random-weight checkpoints of a variant, in the real directory layout (`mossvox make-checkpoint`).

Every registered family says what it can write (`Variant.checkpoints()`, a `CheckpointRecipe`
each: sizes from the family's config helpers, the module whose parameters are the tensors):

| name | talker | codec |
|---|---|---|
| local-v1.5 | MOSS-TTS-Local-Transformer-v1.5 (4B) | v2, 48 kHz stereo |
| delay | MOSS-TTS (8B, n_vq 32) | v1, 24 kHz mono |
| ttsd, sound-effect | MOSS-TTSD / MOSS-SoundEffect (8B, n_vq 16) | v1 |
| voice-generator | MOSS-VoiceGenerator (1.7B, n_vq 16) | v1 |
| realtime | MOSS-TTS-Realtime (1.7B, 16 codebooks) | v1 |

Tiny Delay-family talkers keep the variant's real codebook count (the tiny v1 codec has 32).

A checkpoint directory:

    DIR/config.json                          talker config
    DIR/generation_config.json
    DIR/model.safetensors                    or model-0000k-of-0000n.safetensors + index
    DIR/tokenizer.json, tokenizer_config.json, chat_template.jinja
    DIR/audio_tokenizer/config.json          MOSS-Audio-Tokenizer (v2 or v1 layout)
    DIR/audio_tokenizer/model.safetensors    (or shards + index)

Sizes come from the model owners' config helpers; modules are built on the meta device to read
names and shapes, so writing a full-size checkpoint costs one shard of memory. The weights are
random: a model written here produces noise-like audio and never decides to stop by itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from stages.registry import registered_variants
from stages.tools.outlier_channels import OutlierChannels
from stages.tools.random_weights import WrittenWeights, module_specs, write_weights
from stages.variant import CheckpointRecipe, Size

CODEC_DIR = "audio_tokenizer"
GIB = 1 << 30
# the talker config's delimiter tokens (a turn's start and end, an audio block's start): where
# `outliers` puts massive activations, as released LLMs have them at such tokens
MASSIVE_TOKEN_KEYS = ("im_start_token_id", "im_end_token_id", "audio_start_token_id")
# real checkpoints keep shards of a few GB; tiny ones fit one file
DEFAULT_SHARD_BYTES = {"tiny": 2 * GIB, "full": 2 * GIB}
# stored dtype -> (talker config "dtype", codec config "codec_weight_dtype")
DTYPE_NAMES = {torch.float32: ("float32", "fp32"), torch.bfloat16: ("bfloat16", "bf16"),
               torch.float16: ("float16", "fp16")}


@dataclass(frozen=True)
class CheckpointSummary:
    """What `make_checkpoint` wrote: the talker and codec weights and where they are."""

    out_dir: Path
    talker: WrittenWeights
    codec: WrittenWeights


def checkpoint_recipes() -> dict[str, CheckpointRecipe]:
    """Every checkpoint `make_checkpoint` can write, by name, from the registered families."""
    recipes: dict[str, CheckpointRecipe] = {}
    for cls in registered_variants():
        recipes.update(cls.checkpoints())
    return recipes


def recipe(variant: str) -> CheckpointRecipe:
    recipes = checkpoint_recipes()
    if variant not in recipes:
        raise ValueError(f"variant {variant!r}: supported are {', '.join(recipes)}")
    return recipes[variant]


def talker_config(size: Size, variant: str = "local-v1.5") -> dict:
    return recipe(variant).talker_config(size)


def codec_config(size: Size, variant: str = "local-v1.5") -> dict:
    return recipe(variant).codec_config(size)


def _meta_codec(config: dict) -> nn.Module:
    from stages.models.codec.config import CodecConfig
    from stages.models.codec.model import CodecModel

    with torch.device("meta"):
        return CodecModel(CodecConfig.from_json(config))


def _meta_talker(config: dict, variant: str = "local-v1.5") -> nn.Module:
    with torch.device("meta"):
        return recipe(variant).talker_module(config)


def _is_pointwise_conv(name: str, owner: nn.Module) -> bool:
    """Codec 1x1 convs (quantizer projections) are weight-normed in real checkpoints."""
    return name.startswith("quantizer.") and name.endswith(".weight") and owner.weight.dim() == 3


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _pad_token_id(config: dict) -> int:
    return int(config.get("pad_token_id", config.get("language_config", {}).get("pad_token_id")))


def write_codec(out_dir: Path, config: dict, *, seed: int, dtype: torch.dtype, max_shard_bytes: int,
                on_file: Callable[[Path], None] | None = None) -> WrittenWeights:
    """The codec: config.json + seeded weights (quantizer projections stored weight-normed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if "codec_weight_dtype" in config:  # a v2 key; v1 configs do not carry it
        config = dict(config, codec_weight_dtype=DTYPE_NAMES[dtype][1])
    _write_json(out_dir / "config.json", config)
    specs = module_specs(_meta_codec(config), "codec", weight_norm=_is_pointwise_conv)
    return write_weights(specs, out_dir, seed=seed, style="codec", dtype=dtype, max_shard_bytes=max_shard_bytes,
                         on_file=on_file)


def write_talker(out_dir: Path, config: dict, *, seed: int, dtype: torch.dtype, max_shard_bytes: int,
                 variant: str = "local-v1.5", on_file: Callable[[Path], None] | None = None,
                 outliers: OutlierChannels | None = None) -> WrittenWeights:
    """The talker: config.json, generation_config.json, tokenizer files and seeded weights (with
    `outliers`: its backbone's outlier channels, massive activations at the prompt's delimiters)."""
    from stages.tools.tokenizer_builder import write_tokenizer_files

    writer = recipe(variant)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = writer.finish_config(dict(config, dtype=DTYPE_NAMES[dtype][0]))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {"pad_token_id": _pad_token_id(config)})
    write_tokenizer_files(config, out_dir)
    specs = module_specs(_meta_talker(config, variant), "talker")
    adjust = None
    if outliers is not None:
        delimiters = [config[k] for k in MASSIVE_TOKEN_KEYS if k in config]
        adjust = replace(outliers, massive_tokens=outliers.massive_tokens or tuple(delimiters)).adjust
    return write_weights(specs, out_dir, seed=seed, style="talker", dtype=dtype, max_shard_bytes=max_shard_bytes,
                         on_file=on_file, adjust=adjust)


def make_checkpoint(
    out_dir: str | Path,
    *,
    variant: str = "local-v1.5",
    size: Size = "tiny",
    seed: int = 0,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    on_file: Callable[[Path], None] | None = None,
    outliers: OutlierChannels | None = None,
) -> CheckpointSummary:
    """Write a loadable random-weight checkpoint of `variant` at `size` into `out_dir`.

    dtype: stored dtype (default fp32 for tiny, bf16 for full). The codec gets `seed + 1` so its
    tensors differ from the talker's even where names coincide. on_file: progress callback, called
    with each weight file written. outliers: the talker's backbone gets these outlier channels
    (`stages.tools.outlier_channels`; massive activations at the chat delimiters' tokens unless
    it names tokens).
    """
    writer = recipe(variant)
    if size not in ("tiny", "full"):
        raise ValueError(f"size {size!r}: tiny or full")
    dtype = dtype or (torch.bfloat16 if size == "full" else torch.float32)
    shard = max_shard_bytes or DEFAULT_SHARD_BYTES[size]
    out_dir = Path(out_dir)
    talker = write_talker(out_dir, writer.talker_config(size), seed=seed, dtype=dtype, max_shard_bytes=shard,
                          variant=variant, on_file=on_file, outliers=outliers)
    codec = write_codec(out_dir / CODEC_DIR, writer.codec_config(size), seed=seed + 1, dtype=dtype,
                        max_shard_bytes=shard, on_file=on_file)
    return CheckpointSummary(out_dir, talker, codec)
