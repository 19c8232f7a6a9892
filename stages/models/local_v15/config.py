"""Configuration of MOSS-TTS-Local-Transformer-v1.5 (`model_type: moss_tts_local`, docs/models.md, "Local-v1.5").

`LocalV15Config.from_dict` is the typed view of a checkpoint's `config.json` (the upstream layout:
`qwen3_config`/`language_config`, `gpt2_config`, special ids). `tiny_config()` and
`full_size_config()` return `config.json` dicts for random-weight checkpoints; the full-size shapes
are docs/models.md, "Qwen3 backbone" (Qwen3-4B) and "Local-v1.5" (gpt2 local block), never read from a
real checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.models.qwen3 import Qwen3Config

# Special ids of the real checkpoint (docs/models.md, "Special ids" and "Local-v1.5").
REAL_SPECIAL_IDS = {
    "pad_token_id": 151643,
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "audio_start_token_id": 151669,
    "audio_end_token_id": 151670,
    "audio_user_slot_token_id": 151654,
    "audio_assistant_slot_token_id": 151656,
    "audio_assistant_gen_slot_token_id": 151656,
}

# Special ids of the golden tiny tokenizer (vocab 615): tiny checkpoints pair with it.
TINY_SPECIAL_IDS = {
    "pad_token_id": 605,
    "im_start_token_id": 606,
    "im_end_token_id": 607,
    "audio_start_token_id": 608,
    "audio_end_token_id": 609,
    "audio_user_slot_token_id": 610,
    "audio_assistant_slot_token_id": 611,
    "audio_assistant_gen_slot_token_id": 611,
}


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
class LocalV15Config:
    """Typed `config.json` of a v1.5 talker."""

    backbone: Qwen3Config
    local: LocalBlockConfig
    n_vq: int
    codebook_size: int  # rows of every audio embedding / head
    audio_pad_code: int  # >= codebook_size: masked to a zero embedding
    pad_token_id: int
    im_start: int
    im_end: int
    audio_start: int
    audio_end: int
    user_slot: int
    gen_slot: int  # audio_assistant_slot_token_id: text id of every generated frame row
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
        ids = {**REAL_SPECIAL_IDS, **{k: v for k, v in config.items() if k in REAL_SPECIAL_IDS}}
        slot = config.get("audio_assistant_slot_token_id", ids["audio_assistant_gen_slot_token_id"])
        return cls(
            backbone=backbone,
            local=local,
            n_vq=n_vq,
            codebook_size=int(sizes[0]),
            audio_pad_code=int(config.get("audio_pad_token_id", config.get("audio_pad_code", sizes[0]))),
            pad_token_id=int(ids["pad_token_id"]),
            im_start=int(ids["im_start_token_id"]),
            im_end=int(ids["im_end_token_id"]),
            audio_start=int(ids["audio_start_token_id"]),
            audio_end=int(ids["audio_end_token_id"]),
            user_slot=int(ids["audio_user_slot_token_id"]),
            gen_slot=int(slot),
            sampling_rate=int(config.get("sampling_rate", 48000)),
        )


def _qwen3_dict(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int,
                pad: int, max_positions: int) -> dict[str, Any]:
    return {
        "model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": ffn, "vocab_size": vocab, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "max_position_embeddings": max_positions, "attention_bias": False, "tie_word_embeddings": True,
        "pad_token_id": pad,
    }


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
    qwen = _qwen3_dict(64, 2, 4, 2, 16, 128, 615, TINY_SPECIAL_IDS["pad_token_id"], 4096)
    return _config_dict(qwen, local_heads=4, local_inner=128, n_vq=12, codebook=1024, ids=TINY_SPECIAL_IDS)


def full_size_config() -> dict[str, Any]:
    """The released shapes: Qwen3-4B backbone (2560, 36 layers, 32/8 heads, head_dim 128, FFN 9728,
    vocab 151936, tied) + one gpt2 block (32 heads of 80, n_inner 9728, RoPE base 1e6), n_vq 12,
    codebooks of 1024. About 4.13 B parameters."""
    qwen = _qwen3_dict(2560, 36, 32, 8, 128, 9728, 151936, REAL_SPECIAL_IDS["pad_token_id"], 40960)
    return _config_dict(qwen, local_heads=32, local_inner=9728, n_vq=12, codebook=1024, ids=REAL_SPECIAL_IDS)
