"""Build the v1.5 talker from a `config.json` dict and load a checkpoint directory into it."""

from __future__ import annotations

from pathlib import Path

import torch

from stages.models.local_v15.config import LocalV15Config
from stages.models.local_v15.model import TIED_CHECKPOINT_NAMES, LocalV15Talker
from stages.runtime.checkpoint import load_weights, read_config, read_state_dict


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
