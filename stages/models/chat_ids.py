"""The special ids every MOSS-TTS talker prompt uses (docs/model_facts.md, "Special ids"), under the
`config.json` keys the talker configs share: those of the real Qwen3 vocabulary and those of the
golden tiny tokenizer (docs/model_facts.md, "Golden fixtures") that tiny checkpoints pair with."""

from __future__ import annotations

from dataclasses import dataclass

QWEN3_CHAT_IDS = {
    "pad_token_id": 151643,
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "audio_user_slot_token_id": 151654,
    "audio_assistant_gen_slot_token_id": 151656,
}
TINY_CHAT_IDS = {
    "pad_token_id": 605,
    "im_start_token_id": 606,
    "im_end_token_id": 607,
    "audio_start_token_id": 608,
    "audio_end_token_id": 609,
    "audio_user_slot_token_id": 610,
    "audio_assistant_gen_slot_token_id": 611,
}
# ChatIds field -> its config.json key
CONFIG_KEYS = {"pad_token_id": "pad_token_id", "im_start": "im_start_token_id", "im_end": "im_end_token_id",
               "audio_start": "audio_start_token_id", "audio_end": "audio_end_token_id",
               "user_slot": "audio_user_slot_token_id", "gen_slot": "audio_assistant_gen_slot_token_id"}


@dataclass(frozen=True)
class ChatIds:
    """The special ids of a talker's prompt (a family's config adds its own)."""

    pad_token_id: int  # text channel left pad
    im_start: int
    im_end: int
    audio_start: int
    audio_end: int
    user_slot: int  # a reference-audio row
    gen_slot: int  # a generated frame's row


def read_chat_ids(config: dict, defaults: dict[str, int]) -> dict[str, int]:
    """The `ChatIds` fields of a talker `config.json`: each key's value, else its default."""
    return {name: int(config.get(key, defaults[key])) for name, key in CONFIG_KEYS.items()}
