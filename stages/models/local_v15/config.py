"""Configuration of MOSS-TTS-Local-Transformer-v1.5 (`model_type: moss_tts_local`, docs/model_facts.md, "Local-v1.5").

`LocalV15Config.from_dict` is the typed view of a checkpoint's `config.json` (the upstream layout:
`qwen3_config`/`language_config`, `gpt2_config`, special ids). `tiny_config()` and
`full_size_config()` return `config.json` dicts for random-weight checkpoints; the full-size shapes
are docs/model_facts.md, "Qwen3 backbone" (Qwen3-4B) and "Local-v1.5" (gpt2 local block), never read from a
real checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.models.chat_ids import QWEN3_CHAT_IDS, TINY_CHAT_IDS, ChatIds, read_chat_ids
from stages.models.qwen3 import Qwen3Config, hf_language_config

# Special ids of the real checkpoint and of the golden tiny tokenizer (docs/model_facts.md, "Special ids"):
# v1.5 names the gen slot `audio_assistant_slot_token_id` too.
REAL_SPECIAL_IDS = {**QWEN3_CHAT_IDS, "audio_start_token_id": 151669, "audio_end_token_id": 151670,
                    "audio_assistant_slot_token_id": 151656}
TINY_SPECIAL_IDS = {**TINY_CHAT_IDS, "audio_assistant_slot_token_id": 611}


@dataclass(frozen=True)
class LocalBlockConfig:
    """The GPT-2-style local (depth) transformer: pre-LN blocks, fused qkv, interleaved RoPE."""

    hidden_size: int
    num_layers: int
    num_heads: int
    inner_size: int
    rope_base: float = 1_000_000.0
    layer_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class LocalV15Config(ChatIds):
    """Typed `config.json` of a v1.5 talker (`gen_slot`: `audio_assistant_slot_token_id`)."""

    backbone: Qwen3Config
    local: LocalBlockConfig
    n_vq: int
    codebook_size: int  # rows of every audio embedding / head
    audio_pad_code: int  # >= codebook_size: masked to a zero embedding
    sampling_rate: int = 48000

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> LocalV15Config:
        if config.get("model_type") != "moss_tts_local":
            raise ValueError(f"not a MOSS-TTS-Local v1.5 config: model_type={config.get('model_type')!r}")
        qwen = config.get("qwen3_config") or config["language_config"]
        gpt2 = config.get("gpt2_config") or {}
        backbone = Qwen3Config.from_hf(qwen)
        hidden = backbone.hidden_size
        if int(gpt2.get("n_embd", hidden)) != hidden:
            raise ValueError(f"gpt2_config.n_embd {gpt2.get('n_embd')} != qwen3 hidden_size {hidden}")
        if str(gpt2.get("position_embedding_type", "rope")).lower() != "rope":
            raise ValueError("only gpt2_config.position_embedding_type 'rope' is supported (the released model)")
        if str(config.get("local_text_head_mode", "binary")).lower() != "binary":
            raise ValueError("only local_text_head_mode 'binary' is supported (the released model)")
        n_vq = int(config.get("n_vq", 12))
        sizes = config.get("audio_codebook_sizes") or [int(config.get("audio_vocab_size", 1024))] * n_vq
        if len(set(sizes)) != 1 or len(sizes) != n_vq:
            raise ValueError(f"audio_codebook_sizes {sizes}: expected {n_vq} equal sizes")
        local = LocalBlockConfig(
            hidden_size=hidden,
            num_layers=int(config.get("local_transformer_layers", gpt2.get("n_layer", 1))),
            num_heads=int(gpt2.get("n_head", max(1, hidden // 80))),
            inner_size=int(gpt2.get("n_inner") or 4 * hidden),
            rope_base=float(gpt2.get("rope_base", 1_000_000.0)),
            layer_norm_eps=float(gpt2.get("layer_norm_epsilon", 1e-6)),
        )
        ids = read_chat_ids(config, REAL_SPECIAL_IDS)
        ids["gen_slot"] = int(config.get("audio_assistant_slot_token_id", ids["gen_slot"]))
        return cls(
            backbone=backbone,
            local=local,
            n_vq=n_vq,
            codebook_size=int(sizes[0]),
            audio_pad_code=int(config.get("audio_pad_token_id", config.get("audio_pad_code", sizes[0]))),
            **ids,
            sampling_rate=int(config.get("sampling_rate", 48000)),
        )


def _config_dict(qwen: dict[str, Any], *, local_heads: int, local_inner: int, n_vq: int, codebook: int,
                 ids: dict[str, int]) -> dict[str, Any]:
    hidden = qwen["hidden_size"]
    gpt2 = {
        "model_type": "gpt2", "activation_function": "silu", "n_embd": hidden, "n_layer": 1,
        "n_head": local_heads, "n_inner": local_inner, "n_positions": n_vq + 1, "n_ctx": n_vq + 1,
        "position_embedding_type": "rope", "rope_base": 1000000.0, "layer_norm_epsilon": 1e-6,
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "vocab_size": qwen["vocab_size"],
    }
    return {
        "architectures": ["MossTTSLocalModel"],
        "model_type": "moss_tts_local",
        "qwen3_config": qwen,
        "language_config": qwen,
        "gpt2_config": gpt2,
        "hidden_size": hidden,
        "local_hidden_size": hidden,
        "vocab_size": qwen["vocab_size"],
        "n_vq": n_vq,
        "audio_vocab_size": codebook,
        "audio_codebook_sizes": [codebook] * n_vq,
        "audio_pad_token_id": codebook,
        "audio_pad_code": codebook,
        "local_text_head_mode": "binary",
        "local_transformer_layers": 1,
        "use_static_local_kv_cache": True,
        "tie_word_embeddings": True,
        "sampling_rate": 48000,
        "audio_tokenizer_name_or_path": "OpenMOSS-Team/MOSS-Audio-Tokenizer-v2",
        "attn_implementation": "sdpa",
        "local_transformer_attn_implementation": "sdpa",
        **ids,
    }


def tiny_config() -> dict[str, Any]:
    """CPU-test config: hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16, local 4 heads,
    n_inner 128; pairs with the golden tiny tokenizer's ids (vocab 615). The codebook stays at the
    real 1024 so the v2 codec can decode what it generates."""
    qwen = hf_language_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=615,
                              pad_token_id=TINY_SPECIAL_IDS["pad_token_id"], max_positions=4096,
                              tie_word_embeddings=True)
    return _config_dict(qwen, local_heads=4, local_inner=128, n_vq=12, codebook=1024, ids=TINY_SPECIAL_IDS)


def full_size_config() -> dict[str, Any]:
    """The released shapes: Qwen3-4B backbone (2560, 36 layers, 32/8 heads, head_dim 128, FFN 9728,
    vocab 151936, tied) + one gpt2 block (32 heads of 80, n_inner 9728, RoPE base 1e6), n_vq 12,
    codebooks of 1024. About 4.13 B parameters."""
    qwen = hf_language_config(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=9728, vocab=151936,
                              pad_token_id=REAL_SPECIAL_IDS["pad_token_id"], tie_word_embeddings=True)
    return _config_dict(qwen, local_heads=32, local_inner=9728, n_vq=12, codebook=1024, ids=REAL_SPECIAL_IDS)
