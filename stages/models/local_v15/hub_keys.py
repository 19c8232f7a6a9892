"""Hub bookkeeping keys of a Local-v1.5 `config.json`, as the golden v1.5 config carries them.

The talker's config helpers give the keys the model needs; a checkpoint saved by transformers
also carries `auto_map`, `initializer_range`, `transformers_version` and the Qwen3/GPT-2 config
classes' defaults. Adding them makes a random checkpoint's config.json key-for-key like the
golden one, without changing any size.
"""

from __future__ import annotations

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


def with_local_v15_hub_keys(config: dict) -> dict:
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
