"""Build the v1.5 talker from a `config.json` dict and load a checkpoint directory into it."""

from __future__ import annotations

from pathlib import Path

import torch

from stages.runtime.checkpoint import load_weights, read_config, read_state_dict
from stages.models.local_v15.config import LocalV15Config
from stages.models.local_v15.model import TIED_CHECKPOINT_NAMES, LocalV15Talker


def build_talker_module(config: dict) -> LocalV15Talker:
    """An uninitialised talker of the config's shape (call under `torch.device("meta")` for
    shapes only). Its named parameters are exactly the tensors a checkpoint must hold."""
    return LocalV15Talker(LocalV15Config.from_dict(config))


def load_talker(
    model_dir: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> LocalV15Talker:
    """Strictly load `model_dir` (config.json + safetensors). The tied `text_lm_head` and
    `audio_lm_heads.k` are derived from the embeddings, so they may be absent (save_pretrained
    drops them) or present (ignored, as upstream's tie_weights overrides them)."""
    config = read_config(model_dir)
    with torch.device("meta"):
        model = build_talker_module(config)
    model = model.to_empty(device=device).to(dtype)
    load_weights(model, read_state_dict(model_dir, device=device, dtype=dtype), ignore=TIED_CHECKPOINT_NAMES)
    return model.eval()


def resolve_dtype(profile_dtype: str, device: str) -> torch.dtype:
    """`model.dtype` of a profile: auto = bfloat16 on cuda, float32 elsewhere."""
    if profile_dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[profile_dtype]


def load_talker_runner(model_dir: str | Path, profile, device: str):
    """The `LocalV15Runner` a profile asks for: `talker.*` capacity, attention kernel, graphs and
    torch.compile (CUDA only), `model.dtype`."""
    from stages.models.local_v15.runner import LocalV15Runner

    from stages.runtime.attention.backends import make_attention

    t = profile.talker
    cuda = str(device).startswith("cuda")
    model = load_talker(model_dir, device=device, dtype=resolve_dtype(profile.model.dtype, device))
    if t.compile and cuda:
        model.compile_hot_paths()
    return LocalV15Runner(
        model,
        attention=make_attention(t.attention, device) if cuda or t.attention != "auto" else None,
        max_running=t.max_running,
        kv_block_size=t.kv_block_size,
        num_kv_blocks=t.kv_blocks,
        kv_memory_fraction=t.kv_memory_fraction,
        prefill_chunk_tokens=t.prefill_chunk_tokens,
        max_prefill_tokens_per_step=t.max_prefill_tokens_per_step,
        prefill_interval=t.prefill_interval,
        cuda_graphs=t.cuda_graphs and cuda,
    )
