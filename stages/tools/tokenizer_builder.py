"""A stand-in tokenizer for random-weight checkpoints: byte-level BPE with the config's special ids.

Real MOSS-TTS checkpoints ship Qwen3's tokenizer, which cannot be fetched here. This builds one of
the same kind (Qwen2 pre-tokenizer regex, byte-level BPE, byte-level decoder, no post-processor):
BPE merges learnt from the prompt template and some English, the 256 byte symbols first in GPT-2
order (so "\\n" is 198 as in Qwen), unreachable filler entries up to the first special id, then
the special tokens at exactly the ids `config.json` gives them. For a full-size config that means
ids 151643.. inside a vocabulary sized like Qwen3's.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's own special tokens (their ids are what the MOSS configs point at).
QWEN_SPECIALS = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
    151646: "<|object_ref_start|>", 151647: "<|object_ref_end|>", 151648: "<|box_start|>",
    151649: "<|box_end|>", 151650: "<|quad_start|>", 151651: "<|quad_end|>",
    151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
    151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>", 151658: "</tool_call>",
    151659: "<|fim_prefix|>", 151660: "<|fim_middle|>", 151661: "<|fim_suffix|>", 151662: "<|fim_pad|>",
    151663: "<|repo_name|>", 151664: "<|file_sep|>", 151665: "<tool_response>",
    151666: "</tool_response>", 151667: "<think>", 151668: "</think>",
}

# config key -> token string (the names the golden tokenizer uses for the MOSS roles)
ROLE_TOKENS = {
    "pad_token_id": "<|endoftext|>",
    "im_start_token_id": "<|im_start|>",
    "im_end_token_id": "<|im_end|>",
    "audio_start_token_id": "<|audio_start|>",
    "audio_end_token_id": "<|audio_end|>",
    "audio_user_slot_token_id": "<|audio_user_slot|>",
    "audio_assistant_slot_token_id": "<|audio_assistant_gen_slot|>",
    "audio_assistant_gen_slot_token_id": "<|audio_assistant_gen_slot|>",
    "audio_assistant_delay_slot_token_id": "<|audio_assistant_delay_slot|>",
    "reference_audio_pad": "<|audio_pad|>",  # Realtime
    "text_pad": "<|text_pad|>",  # Realtime
}

TRAINING_TEXT = (
    "<user_inst>\n- Reference(s):\nNone\n- Instruction:\nNone\n- Tokens:\nNone\n- Quality:\nNone\n"
    "- Sound Event:\nNone\n- Ambient Sound:\nNone\n- Language:\nEnglish\n- Text:\nHello.\n</user_inst>\n"
    "user\nassistant\n",
    "Hello world, this is a short test of the speech engine. The quick brown fox jumps over the lazy dog.",
    "Streaming audio is generated while the model is still speaking; every frame lasts eighty milliseconds.",
    "She said: [pause 1.5s] and then, after a while, they went home together in the evening light.",
    "Numbers 0 1 2 3 4 5 6 7 8 9, questions? Answers! Quotes \"like this\" and 'that'.",
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def gpt2_byte_symbols() -> list[str]:
    """The 256 byte-level symbols in GPT-2 order (printable bytes first, then the rest)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in printable] + [symbols[b] for b in range(256) if b not in printable]


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _learn_merges(max_tokens: int) -> list[tuple[str, str]]:
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=max_tokens, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    trainer_tok.train_from_iterator(list(TRAINING_TEXT) * 4, trainer=trainer)
    merges = json.loads(trainer_tok.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


def _chatml_ids(config: dict) -> dict[str, int]:
    """pad / im_start / im_end ids. A config without them at the top level (Realtime keeps only
    `language_config.pad_token_id`) gets im_start = pad + 1 and im_end = pad + 2, the layout of
    both Qwen3 (151643..151645) and the golden tiny tokenizer (605..607)."""
    pad = config.get("pad_token_id", config.get("language_config", {}).get("pad_token_id"))
    if pad is None:
        raise KeyError("config has no pad_token_id (top level or language_config)")
    return {
        "pad_token_id": int(pad),
        "im_start_token_id": int(config.get("im_start_token_id", int(pad) + 1)),
        "im_end_token_id": int(config.get("im_end_token_id", int(pad) + 2)),
    }


def special_tokens_for(config: dict) -> dict[int, str]:
    """id -> token string of every special token the config names (roles win over Qwen names)."""
    config = {**config, **_chatml_ids(config)}
    specials: dict[int, str] = {}
    for key, token in ROLE_TOKENS.items():
        if key in config and int(config[key]) not in specials:
            specials[int(config[key])] = token
    if min(specials) >= min(QWEN_SPECIALS):
        for token_id, token in QWEN_SPECIALS.items():
            specials.setdefault(token_id, token)
    seen: dict[str, int] = {}
    for token_id, token in sorted(specials.items()):
        if token in seen:  # one string cannot sit at two ids (e.g. a role moved off a Qwen id)
            specials[token_id] = f"<|reserved_special_{token_id}|>"
        seen.setdefault(token, token_id)
    return specials


def build_tokenizer(config: dict) -> Tokenizer:
    """A byte-level BPE tokenizer whose special tokens sit at the ids `config` gives them."""
    specials = special_tokens_for(config)
    first_special = min(specials)
    if first_special < 256 + 16:
        raise ValueError(f"special ids start at {first_special}: no room for the 256 byte symbols and merges")
    vocab: dict[str, int] = {s: i for i, s in enumerate(gpt2_byte_symbols())}
    merges = []
    for left, right in _learn_merges(max_tokens=min(first_special, 2000)):
        if len(vocab) >= first_special:
            break
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
    while len(vocab) < first_special:  # unreachable fillers: no merge produces them
        vocab[f"<|filler_{len(vocab)}|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    last = max(specials)
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = [
        {"id": i, "content": specials.get(i, f"<|reserved_special_{i}|>"), "single_word": False,
         "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        for i in range(first_special, last + 1)
    ]
    return Tokenizer.from_str(json.dumps(data))


def write_tokenizer_files(config: dict, out_dir: str | Path) -> Tokenizer:
    """Write `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` into `out_dir`."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = _chatml_ids(config)
    tokenizer_config = {
        "backend": "tokenizers",
        "bos_token": None,
        "eos_token": tokenizer.id_to_token(ids["im_end_token_id"]),
        "pad_token": tokenizer.id_to_token(ids["pad_token_id"]),
        "unk_token": None,
        "model_max_length": 131072,
        "tokenizer_class": "TokenizersBackend",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return tokenizer
