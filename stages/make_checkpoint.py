"""Random-weight checkpoints of a variant, in the real directory layout (`mossvox make-checkpoint`).

A Local-v1.5 checkpoint directory:

    DIR/config.json                          talker config (the golden v1.5 keys)
    DIR/generation_config.json
    DIR/model.safetensors                    or model-0000k-of-0000n.safetensors + index
    DIR/tokenizer.json, tokenizer_config.json, chat_template.jinja
    DIR/audio_tokenizer/config.json          MOSS-Audio-Tokenizer-v2 layout
    DIR/audio_tokenizer/model.safetensors    (or shards + index)

Sizes come from the model owners' config helpers (`stages.local_v15.config`,
`stages.codec.config`); modules are built on the meta device to read names and shapes, so
writing a full-size checkpoint costs one shard of memory. The weights are random: a model written
here produces noise-like audio and never decides to stop by itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from stages.random_weights import WrittenWeights, module_specs, write_weights

Size = Literal["tiny", "full"]
VARIANTS = ("local-v1.5",)
CODEC_DIR = "audio_tokenizer"
GIB = 1 << 30
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


def codec_config(size: Size) -> dict:
    from stages.codec.config import full_size_v2_config, tiny_v2_config

    return full_size_v2_config() if size == "full" else tiny_v2_config()


def talker_config(size: Size) -> dict:
    from stages.local_v15.config import full_size_config, tiny_config

    return full_size_config() if size == "full" else tiny_config()


QWEN3_DEFAULTS = {
    "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None, "initializer_range": 0.02,
    "max_window_layers": 28, "sliding_window": None, "use_cache": True, "use_sliding_window": False,
}
GPT2_DEFAULTS = {
    "add_cross_attention": False, "bos_token_id": 50256, "eos_token_id": 50256, "initializer_range": 0.02,
    "pad_token_id": None, "reorder_and_upcast_attn": False, "scale_attn_by_inverse_layer_idx": False,
    "scale_attn_weights": True, "summary_activation": None, "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
    "tie_word_embeddings": True, "use_cache": True,
}


def with_hf_keys(config: dict) -> dict:
    """The talker config with the bookkeeping keys a hub checkpoint's config.json carries
    (auto_map, initializer_range, transformers_version, Qwen3/GPT-2 defaults), as in the golden
    v1.5 config. Keys already present are kept; no size changes."""
    out = dict(config)
    out.setdefault("auto_map", {
        "AutoConfig": "configuration_moss_tts.MossTTSLocalConfig",
        "AutoModel": "modeling_moss_tts.MossTTSLocalModel",
        "AutoProcessor": "processing_moss_tts.MossTTSLocalProcessor",
    })
    out.setdefault("initializer_range", 0.02)
    out.setdefault("transformers_version", "5.0.0")
    for key in ("qwen3_config", "language_config"):
        if key in out:
            qwen = dict(out[key])
            layers = int(qwen["num_hidden_layers"])
            for k, v in QWEN3_DEFAULTS.items():
                qwen.setdefault(k, v)
            qwen.setdefault("layer_types", ["full_attention"] * layers)
            out[key] = qwen
    if "gpt2_config" in out:
        gpt2 = dict(out["gpt2_config"])
        for k, v in GPT2_DEFAULTS.items():
            gpt2.setdefault(k, v)
        out["gpt2_config"] = gpt2
    return out


def _meta_codec(config: dict) -> nn.Module:
    from stages.codec.config import CodecConfig
    from stages.codec.model import CodecModel

    with torch.device("meta"):
        return CodecModel(CodecConfig.from_json(config))


def _meta_talker(config: dict) -> nn.Module:
    from stages.local_v15.loader import build_talker_module

    with torch.device("meta"):
        return build_talker_module(config)


def _is_pointwise_conv(name: str, owner: nn.Module) -> bool:
    """Codec 1x1 convs (quantizer projections) are weight-normed in real checkpoints."""
    return name.startswith("quantizer.") and name.endswith(".weight") and owner.weight.dim() == 3


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_codec(out_dir: Path, config: dict, *, seed: int, dtype: torch.dtype, max_shard_bytes: int) -> WrittenWeights:
    """The v2 codec: config.json + seeded weights (quantizer projections stored weight-normed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if "codec_weight_dtype" in config:  # a v2 key; v1 configs do not carry it
        config = dict(config, codec_weight_dtype=DTYPE_NAMES[dtype][1])
    _write_json(out_dir / "config.json", config)
    specs = module_specs(_meta_codec(config), "codec", weight_norm=_is_pointwise_conv)
    return write_weights(specs, out_dir, seed=seed, style="codec", dtype=dtype, max_shard_bytes=max_shard_bytes)


def write_talker(out_dir: Path, config: dict, *, seed: int, dtype: torch.dtype, max_shard_bytes: int) -> WrittenWeights:
    """The talker: config.json, generation_config.json, tokenizer files and seeded weights."""
    from stages.tokenizer_builder import write_tokenizer_files

    out_dir.mkdir(parents=True, exist_ok=True)
    config = with_hf_keys(dict(config, dtype=DTYPE_NAMES[dtype][0]))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {"pad_token_id": config["pad_token_id"]})
    write_tokenizer_files(config, out_dir)
    specs = module_specs(_meta_talker(config), "talker")
    return write_weights(specs, out_dir, seed=seed, style="talker", dtype=dtype, max_shard_bytes=max_shard_bytes)


def make_checkpoint(
    out_dir: str | Path,
    *,
    variant: str = "local-v1.5",
    size: Size = "tiny",
    seed: int = 0,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> CheckpointSummary:
    """Write a loadable random-weight checkpoint of `variant` at `size` into `out_dir`.

    dtype: stored dtype (default fp32 for tiny, bf16 for full). The codec gets `seed + 1` so its
    tensors differ from the talker's even where names coincide.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: supported are {', '.join(VARIANTS)}")
    if size not in ("tiny", "full"):
        raise ValueError(f"size {size!r}: tiny or full")
    dtype = dtype or (torch.bfloat16 if size == "full" else torch.float32)
    shard = max_shard_bytes or DEFAULT_SHARD_BYTES[size]
    out_dir = Path(out_dir)
    talker = write_talker(out_dir, talker_config(size), seed=seed, dtype=dtype, max_shard_bytes=shard)
    codec = write_codec(out_dir / CODEC_DIR, codec_config(size), seed=seed + 1, dtype=dtype, max_shard_bytes=shard)
    return CheckpointSummary(out_dir, talker, codec)
