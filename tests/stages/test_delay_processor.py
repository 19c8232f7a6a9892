"""The Delay prompt processor reproduces upstream's golden prompts (ids and mask) exactly."""

import json
import numpy as np
import pytest

from stages.models.delay.processor import DelayProcessor
from tests.conftest import golden_case, golden_dir

GOLDEN = golden_dir("moss_tts_delay")


@pytest.fixture(scope="module")
def processor() -> DelayProcessor:
    return DelayProcessor.from_dir(GOLDEN)


@pytest.fixture(scope="module")
def cases() -> dict:
    return json.loads((GOLDEN / "cases.json").read_text())["cases"]


def golden(name: str) -> dict[str, np.ndarray]:
    return golden_case(GOLDEN, name)


def check(processor, prompt, name):
    g = golden(name)
    ids, mask = processor.pad_batch([prompt])
    np.testing.assert_array_equal(ids[0], g["input_ids"])
    np.testing.assert_array_equal(mask[0], g["attention_mask"])


def test_plain(processor, cases):
    text = cases["plain"]["raw_text_passed_to_build_user_message"]
    check(processor, processor.build_prompt(text, language="English"), "plain")


def test_voice_clone(processor, cases):
    text = cases["voice_clone"]["raw_text_passed_to_build_user_message"]
    ref = golden("voice_clone")["reference_audio_codes"]
    check(processor, processor.build_prompt(text, references=[ref], language="English"), "voice_clone")


def test_continuation(processor, cases):
    text = cases["continuation"]["raw_text_passed_to_build_user_message"]
    prompt_codes = golden("continuation")["prompt_audio_codes"]
    prompt = processor.build_prompt(text, prompt_codes=prompt_codes, language="English")
    check(processor, prompt, "continuation")
    assert prompt[-1, 0] == processor.config.gen_slot  # generation resumes inside audio


def test_text_is_normalized_before_tokenizing(processor):
    messy = processor.build_prompt("Hello   world ,  this is a tiny golden test.", language="English")
    clean = processor.build_prompt("Hello world, this is a tiny golden test.", language="English")
    np.testing.assert_array_equal(messy, clean)


def test_speaker_numbering_skips_missing_references(processor):
    """TTSD: references[i] is speaker S{i+1}; a None keeps the numbering but adds no block."""
    ref = golden("voice_clone")["reference_audio_codes"]
    prompt = processor.build_prompt("[S1]Hi.[S2]Hello.", references=[None, ref])
    text = processor.tokenizer.decode(prompt[prompt[:, 0] < 605, 0].tolist())
    assert "[S2]:\n" in text and "[S1]:\n" not in text
    assert (prompt[:, 0] == processor.config.user_slot).sum() == ref.shape[0] + processor.config.n_vq - 1


def test_bad_reference_shape_is_rejected(processor):
    with pytest.raises(ValueError, match=r"\[T>=1, 32\]"):
        processor.build_prompt("x", references=[np.zeros((4, 16), dtype=np.int64)])
