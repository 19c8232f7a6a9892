"""Configuration of MOSS-TTS-Realtime (`model_type: moss_tts_realtime`, docs/model_facts.md, "Realtime").

The local depth transformer's config class upstream hard-codes `rvq = 16`, `audio_vocab_size =
1027` and `audio_pad_token = 1024` whatever config.json says; `RealtimeConfig.from_dict` does the
same. Audio ids: 0..1023 codes, 1024 pad, 1025 audio BOS, 1026 audio EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.models.qwen3 import hf_language_config

RVQ = 16
AUDIO_VOCAB = 1027
AUDIO_PAD, AUDIO_BOS, AUDIO_EOS = 1024, 1025, 1026
PREFILL_TEXT_TOKENS = 12  # upstream `delay_tokens_len`: audio starts 12 text tokens in


@dataclass(frozen=True)
class RealtimeConfig:
    """Typed `config.json` of a Realtime checkpoint; `language` / `local` are Qwen3-shaped dicts."""

    language: dict[str, Any]
    local: dict[str, Any]
    reference_audio_pad: int
    text_pad: int
    pad_token_id: int
    rvq: int = RVQ
    audio_vocab_size: int = AUDIO_VOCAB
    audio_pad: int = AUDIO_PAD
    audio_bos: int = AUDIO_BOS
    audio_eos: int = AUDIO_EOS
    sampling_rate: int = 24000

    @property
    def hidden_size(self) -> int:
        return int(self.language["hidden_size"])

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> RealtimeConfig:
        if config.get("model_type") != "moss_tts_realtime":
            raise ValueError(f"not a Realtime config: model_type={config.get('model_type')!r}")
        language = dict(config["language_config"])
        local = dict(config["local_config"])
        if int(local["hidden_size"]) != int(language["hidden_size"]):
            raise ValueError("local_config.hidden_size must equal the backbone hidden size")
        return cls(
            language=language,
            local={**local, "vocab_size": AUDIO_VOCAB},
            reference_audio_pad=int(config.get("reference_audio_pad", 151654)),
            text_pad=int(config.get("text_pad", 151655)),
            pad_token_id=int(language.get("pad_token_id", 151643)),
        )


def _local_config(*, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> dict[str, Any]:
    return {
        "model_type": "moss_tts_realtime_local_transformer",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": ffn,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 33,
        "rope_theta": 1000000, "rope_type": "linear",
        "rope_parameters": {"factor": 1.0, "rope_theta": 1000000, "rope_type": "linear"},
        "attention_bias": False, "pad_token_id": AUDIO_PAD, "rvq": RVQ,
        "audio_vocab_size": AUDIO_VOCAB, "audio_pad_token": AUDIO_PAD,
    }


def _realtime_config(language: dict[str, Any], local: dict[str, Any], audio_pad_id: int, text_pad_id: int) -> dict:
    return {
        "architectures": ["MossTTSRealtime"], "model_type": "moss_tts_realtime",
        "language_config": language, "local_config": local, "rvq": RVQ,
        "audio_vocab_size": AUDIO_VOCAB, "audio_pad_token": AUDIO_PAD,
        "reference_audio_pad": audio_pad_id, "text_pad": text_pad_id, "initializer_range": 0.02,
    }


def tiny_config() -> dict[str, Any]:
    """CPU-test shapes (docs/model_facts.md, "Golden fixtures") that pair with the golden tiny tokenizer (vocab 615)."""
    language = hf_language_config(hidden=16, layers=2, heads=2, kv_heads=1, head_dim=8, ffn=48, vocab=615,
                                  pad_token_id=605, max_positions=4096)
    local = _local_config(hidden=16, layers=2, heads=2, kv_heads=1, head_dim=8, ffn=48)
    return _realtime_config(language, local, 613, 614)


def full_size_config() -> dict[str, Any]:
    """Qwen3-1.7B backbone + 4-layer depth transformer "aligned with Qwen3-1.7B" (docs/model_facts.md, "Realtime")."""
    language = hf_language_config(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=6144,
                                  vocab=151936, pad_token_id=151643)
    local = _local_config(hidden=2048, layers=4, heads=16, kv_heads=8, head_dim=128, ffn=6144)
    return _realtime_config(language, local, 151654, 151655)
