"""Load a MOSS-Audio-Tokenizer checkpoint directory (`config.json` + safetensors) into `CodecModel`.

Accepted spellings besides the canonical names: FFN `ffn.0` / `ffn.2` (an untested third-party
converter's names) for `linear1` / `linear2`; attention `in_proj.weight` / `in_proj_weight` /
`out_proj.weight` for `in_projs.0.weight` / `out_projs.0.weight` (upstream's load hook). Weight
norm (`parametrizations.weight.original0/1`, `weight_g/_v`) is folded by `stages.runtime.checkpoint`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stages.models.codec.config import CodecConfig
from stages.models.codec.model import CodecModel
from stages.runtime.checkpoint import load_weights, read_config, read_state_dict

CODEC_RENAMES = (
    (r"\.ffn\.0\.weight$", ".linear1.weight"),
    (r"\.ffn\.2\.weight$", ".linear2.weight"),
    (r"\.self_attn\.in_proj(?:_weight|\.weight)$", ".self_attn.in_projs.0.weight"),
    (r"\.self_attn\.out_proj\.weight$", ".self_attn.out_projs.0.weight"),
)


def build_codec(cfg: CodecConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> CodecModel:
    """An uninitialised model on `device`: transformers in `dtype`, the quantizer in fp32."""
    with torch.device("meta"):
        model = CodecModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.quantizer.float()
    return model.eval().requires_grad_(False)


def load_codec(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> CodecModel:
    """Build the codec described by `model_dir/config.json` and load its weights strictly."""
    cfg = CodecConfig.from_json(read_config(model_dir))
    model = build_codec(cfg, device, dtype)
    load_weights(model, read_state_dict(model_dir), rename=CODEC_RENAMES)
    return model
