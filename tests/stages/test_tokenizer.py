"""The checkpoint tokenizer reproduces the golden tokenizer's ids (and round-trips text)."""

import json

import pytest

from stages.runtime.tokenizer import TextTokenizer
from tests.conftest import golden_dir

GOLDEN = golden_dir("moss_tts_local_v1_5")


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(GOLDEN)


def test_vocab_includes_special_tokens(tokenizer):
    config = json.loads((GOLDEN / "config.json").read_text())
    assert tokenizer.vocab_size == config["vocab_size"] == 615


def test_byte_level_ids_match_qwen_layout(tokenizer):
    # the 256 byte symbols come first in GPT-2 order: "\n" is 198 as in Qwen
    assert tokenizer.encode("\n") == [198]
    assert tokenizer.encode("") == []


def test_no_special_tokens_added_and_round_trip(tokenizer):
    text = "Hello world, this is a tiny golden test. [pause 1.5s] Ünïcode ok?"
    ids = tokenizer.encode(text)
    assert all(i < 605 for i in ids)  # plain text never yields a special id
    assert tokenizer.decode(ids) == text


def test_special_token_strings_map_to_config_ids(tokenizer):
    # strings are only checked here; the processor itself reads ids from config.json
    config = json.loads((GOLDEN / "config.json").read_text())
    assert tokenizer.encode("<|im_start|>") == [config["im_start_token_id"]]
    assert tokenizer.encode("<|audio_start|>") == [config["audio_start_token_id"]]


def test_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)
