"""The Realtime prompt processor reproduces upstream's golden prompt and prefill ids exactly."""

import json
import numpy as np
import pytest

from stages.models.realtime.processor import RealtimeProcessor, split_prompt
from tests.conftest import golden_case, golden_dir

GOLDEN = golden_dir("moss_tts_realtime")


@pytest.fixture(scope="module")
def processor() -> RealtimeProcessor:
    return RealtimeProcessor.from_dir(GOLDEN)


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((GOLDEN / "cases.json").read_text())


def golden(name: str) -> dict[str, np.ndarray]:
    return golden_case(GOLDEN, name)


@pytest.mark.parametrize("name", ["plain", "voice_clone"])
def test_prompt_and_prefill_match_golden(processor, meta, name):
    g = golden(name)
    reference = g.get("reference_audio_codes")
    np.testing.assert_array_equal(processor.prompt_rows(reference), g["input_ids"])
    assert processor.text_ids(meta["text"]) == g["text_ids"].tolist()
    prompt = processor.build_prompt(meta["text"], reference=reference)
    prefill, rest = split_prompt(prompt, processor.config.audio_bos)
    np.testing.assert_array_equal(prefill, g["prefill_input_ids"])
    assert rest == g["text_ids"][12:].tolist()


def test_short_text_puts_bos_on_its_last_token(processor):
    prompt = processor.build_prompt("Hi.")
    prefill, rest = split_prompt(prompt, processor.config.audio_bos)
    assert rest == [] and prefill[-1, 1] == processor.config.audio_bos
    assert prefill.shape[0] == processor.prompt_rows().shape[0] + len(processor.text_ids("Hi."))


def test_empty_text_is_rejected(processor):
    with pytest.raises(ValueError, match="non-empty"):
        processor.build_prompt("")
