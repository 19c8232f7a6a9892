"""MOSS-Audio-Tokenizer v1 (24 kHz mono) and v2 (48 kHz stereo): model, exact streaming decode, loader."""

from stages.models.codec.config import (
    CodecConfig,
    full_size_v1_config,
    full_size_v2_config,
    tiny_v1_config,
    tiny_v2_config,
)
from stages.models.codec.loader import build_codec, load_codec
from stages.models.codec.model import CodecModel, EncodeResult, count_parameters

__all__ = [
    "CodecConfig", "CodecModel", "EncodeResult", "build_codec", "count_parameters", "load_codec",
    "full_size_v1_config", "full_size_v2_config", "tiny_v1_config", "tiny_v2_config",
]
