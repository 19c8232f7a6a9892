"""Configuration of the Delay talker (`model_type: moss_tts_delay`, docs/model_facts.md, "Delay family").

`DelayConfig` is the typed view of a checkpoint's `config.json`; `tiny_config()` and
`full_size_config()` return `config.json` dicts for random-weight checkpoints (the real
checkpoints' configs were never read; the full-size shapes: docs/model_facts.md, "Qwen3 backbone" and
"Delay family").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.models.chat_ids import QWEN3_CHAT_IDS, TINY_CHAT_IDS, ChatIds, read_chat_ids
from stages.models.qwen3 import hf_language_config

# Special ids of the real checkpoints and of the golden tiny tokenizer (docs/model_facts.md, "Special ids").
REAL_SPECIAL_IDS = {**QWEN3_CHAT_IDS, "audio_start_token_id": 151652, "audio_end_token_id": 151653,
                    "audio_assistant_delay_slot_token_id": 151662}
TINY_SPECIAL_IDS = {**TINY_CHAT_IDS, "audio_assistant_delay_slot_token_id": 612}

# The Delay variants: n_vq per released checkpoint (docs/model_facts.md, "Served models").
VARIANT_N_VQ = {"moss-tts": 32, "ttsd": 16, "sound-effect": 16, "voice-generator": 16}


@dataclass(frozen=True)
class DelayConfig(ChatIds):
    """Typed `config.json` of a Delay checkpoint. `language` is the Qwen3 backbone's dict."""

    language: dict[str, Any]
    n_vq: int
    audio_vocab_size: int
    audio_pad_code: int
    delay_slot: int
    sampling_rate: int = 24000

    @property
    def hidden_size(self) -> int:
        return int(self.language["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.language["vocab_size"])

    @property
    def audio_rows(self) -> int:
        """Rows of every audio table and head: the codes plus the learned pad row."""
        return self.audio_vocab_size + 1

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DelayConfig:
        if config.get("model_type") != "moss_tts_delay":
            raise ValueError(f"not a Delay config: model_type={config.get('model_type')!r}")
        if "local_num_layers" in config:
            raise ValueError("this is a MOSS-TTS-Local v1 config (has local_num_layers), not a Delay config")
        audio_vocab = int(config.get("audio_vocab_size", 1024))
        return cls(
            language=dict(config["language_config"]),
            n_vq=int(config.get("n_vq", 32)),
            audio_vocab_size=audio_vocab,
            audio_pad_code=int(config.get("audio_pad_code", audio_vocab)),
            **read_chat_ids(config, REAL_SPECIAL_IDS),
            delay_slot=int(config.get("audio_assistant_delay_slot_token_id",
                                      REAL_SPECIAL_IDS["audio_assistant_delay_slot_token_id"])),
            sampling_rate=int(config.get("sampling_rate", 24000)),
        )


def _delay_config(language: dict[str, Any], n_vq: int, audio_vocab: int, ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["MossTTSDelayModel"],
        "model_type": "moss_tts_delay",
        "language_config": language,
        "n_vq": n_vq,
        "audio_vocab_size": audio_vocab,
        "audio_pad_code": audio_vocab,
        "sampling_rate": 24000,
        "hidden_size": language["hidden_size"],
        "vocab_size": language["vocab_size"],
        "tie_word_embeddings": False,
        **ids,
    }


def tiny_config(n_vq: int = 4) -> dict[str, Any]:
    """A CPU-test Delay config that pairs with the golden tiny tokenizer (vocab 615).

    The audio vocabulary stays at the real 1024 so the v1 codec (1024 codes) can decode it.
    """
    language = hf_language_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128,
                                  vocab=615, pad_token_id=TINY_SPECIAL_IDS["pad_token_id"], max_positions=4096)
    return _delay_config(language, n_vq, 1024, TINY_SPECIAL_IDS)


def full_size_config(variant: str = "moss-tts") -> dict[str, Any]:
    """Real shapes: `moss-tts` (8B, n_vq 32), `ttsd` / `sound-effect` (8B, n_vq 16),
    `voice-generator` (1.7B, n_vq 16). Vocabulary 155648 for the 8B models (pinned by the v1.5
    index size, docs/model_facts.md, "Served models"); 151936 (Qwen3-1.7B) for VoiceGenerator, which is unconfirmed."""
    if variant not in VARIANT_N_VQ:
        raise ValueError(f"unknown Delay variant {variant!r}; choose one of {sorted(VARIANT_N_VQ)}")
    pad = REAL_SPECIAL_IDS["pad_token_id"]
    if variant == "voice-generator":
        language = hf_language_config(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=6144,
                                      vocab=151936, pad_token_id=pad)
    else:
        language = hf_language_config(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=12288,
                                      vocab=155648, pad_token_id=pad)
    return _delay_config(language, VARIANT_N_VQ[variant], 1024, REAL_SPECIAL_IDS)
