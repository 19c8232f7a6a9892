"""Delay request adapters: each variant's prompt rules, its errors, and its sampling defaults."""


import numpy as np
import pytest

from stages.models.delay.adapters import (SAMPLING_DEFAULTS, AdapterError, DelayRequest, build_request,
                                   variant_for_config)
from stages.models.delay.processor import DelayProcessor
from tests.conftest import golden_dir

GOLDEN = golden_dir("moss_tts_delay")


@pytest.fixture(scope="module")
def processor() -> DelayProcessor:
    return DelayProcessor.from_dir(GOLDEN)


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / f"case_{name}.npz") as z:
        return {k: z[k] for k in z.files}


def decoded(processor, prompt) -> str:
    return processor.tokenizer.decode([t for t in prompt[:, 0].tolist() if t < 605])


def test_moss_tts_reproduces_the_golden_prompts(processor):
    g = golden("voice_clone")
    text = "Hello world, this is a tiny golden test."
    np.testing.assert_array_equal(
        build_request(processor, "moss-tts", DelayRequest(text, language="English")), golden("plain")["input_ids"])
    np.testing.assert_array_equal(
        build_request(processor, "moss-tts", DelayRequest(text, language="English",
                                                          ref_codes=[g["reference_audio_codes"]])), g["input_ids"])
    c = golden("continuation")
    prompt = build_request(processor, "moss-tts", DelayRequest(
        text, language="English", ref_codes=[c["prompt_audio_codes"]], ref_texts=["Reference words come first."]))
    np.testing.assert_array_equal(prompt, c["input_ids"])


def test_moss_tts_errors(processor):
    ref = golden("voice_clone")["reference_audio_codes"]
    with pytest.raises(AdapterError, match="at most one reference"):
        build_request(processor, "moss-tts", DelayRequest("x", ref_codes=[ref, ref]))
    with pytest.raises(AdapterError, match="ref_text needs reference audio"):
        build_request(processor, "moss-tts", DelayRequest("x", ref_texts=["hi"]))
    with pytest.raises(AdapterError, match="input text is required"):
        build_request(processor, "moss-tts", DelayRequest("  "))
    with pytest.raises(AdapterError, match=r"shape \[T>=1, 32\]"):
        build_request(processor, "moss-tts", DelayRequest("x", ref_codes=[np.zeros((3, 8), dtype=np.int64)]))


def test_ttsd_cloning_is_continuation_on_all_references(processor):
    ref = golden("voice_clone")["reference_audio_codes"]  # [6, 32]
    ref2 = golden("continuation")["prompt_audio_codes"]  # [5, 32]
    prompt = build_request(processor, "ttsd", DelayRequest(
        "[S2]Hi![S1]Hello there.", ref_codes=[ref, ref2], ref_texts=["First voice.", "[S2]Second voice."]))
    text = decoded(processor, prompt)
    assert "[S1]:\n" in text and "[S2]:\n" in text  # both references in the user turn
    # transcripts first, each under its tag; the repeated [S2] at the seam is merged away
    assert "- Text:\n[S1]First voice.[S2]Second voice.Hi![S1]Hello there.\n" in text
    cfg = processor.config
    assert prompt[-1, 0] == cfg.gen_slot and (prompt[:, 0] == cfg.gen_slot).sum() == len(ref) + len(ref2)


def test_ttsd_errors(processor):
    ref = golden("voice_clone")["reference_audio_codes"]
    with pytest.raises(AdapterError, match=r"\[S1\] to \[S5\]"):
        build_request(processor, "ttsd", DelayRequest("[S1]a[S6]b"))
    with pytest.raises(AdapterError, match="S2: reference audio and its transcript"):
        build_request(processor, "ttsd", DelayRequest("[S1]a[S2]b", ref_codes=[None, ref]))
    plain = build_request(processor, "ttsd", DelayRequest("[S1]a[S2]b"))
    assert plain[-1, 0] != processor.config.gen_slot  # no references: generation mode


def test_ttsd_untagged_text_is_spoken_by_s1(processor):
    untagged = build_request(processor, "ttsd", DelayRequest("One speaker only."))
    assert "- Text:\n[S1] One speaker only.\n" in decoded(processor, untagged)
    assert (untagged == build_request(processor, "ttsd", DelayRequest("[S1] One speaker only."))).all()


def test_sound_effect_puts_the_description_in_ambient_sound(processor):
    prompt = build_request(processor, "sound-effect", DelayRequest("rain on a tin roof", tokens=50))
    text = decoded(processor, prompt)
    assert "- Ambient Sound:\nrain on a tin roof\n" in text and "- Text:\nNone\n" in text
    assert "- Tokens:\n50\n" in text


def test_voice_generator_needs_instructions(processor):
    prompt = build_request(processor, "voice-generator", DelayRequest("Hello.", instructions="a warm old voice"))
    assert "- Instruction:\na warm old voice\n" in decoded(processor, prompt)
    with pytest.raises(AdapterError, match="instructions"):
        build_request(processor, "voice-generator", DelayRequest("Hello."))


def test_sampling_defaults_follow_the_model_cards():
    got = {k: (v.temperature, v.top_p, v.top_k, v.repetition_penalty) for k, v in SAMPLING_DEFAULTS.items()}
    assert got == {"moss-tts": (1.7, 0.8, 25, 1.0), "ttsd": (1.1, 0.9, 50, 1.1),
                   "voice-generator": (1.5, 0.6, 50, 1.1), "sound-effect": (1.5, 0.6, 50, 1.2)}
    assert all(v.text_temperature == 1.5 and v.text_top_k == 50 for v in SAMPLING_DEFAULTS.values())


def test_variant_for_config():
    assert variant_for_config({"n_vq": 32}) == "moss-tts"
    assert variant_for_config({"n_vq": 16}, "ttsd") == "ttsd"
    with pytest.raises(ValueError, match="name the variant"):
        variant_for_config({"n_vq": 16})
