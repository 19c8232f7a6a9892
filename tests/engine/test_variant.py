"""The Local-v1.5 variant's request adapter: prompt modes, sampling overrides, forced length."""

import numpy as np
import pytest

from profiles import load_profile
from stages.registry import load_variant
from stages.variant import UnknownModel
from tests.conftest import golden_dir, speech_job


@pytest.fixture(scope="module")
def variant():
    codec = golden_dir("moss_audio_tokenizer_v2")
    profile = load_profile("cpu", [f"model.codec_path={codec}", "model.max_new_frames=100"])
    return load_variant(golden_dir("moss_tts_local_v1_5"), profile)


def test_shape_facts_come_from_the_configs(variant) -> None:
    assert (variant.n_vq, variant.sample_rate, variant.channels) == (12, 48000, 2)
    assert variant.frame_rate == 12.5


def test_prompt_modes(variant) -> None:
    plain = variant.build_request(speech_job()).prompt
    codes = np.arange(5 * 12, dtype=np.int64).reshape(5, 12) % 7
    clone = variant.build_request(speech_job(ref_codes=codes)).prompt
    cont = variant.build_request(speech_job(ref_codes=codes, ref_text="before. ")).prompt
    assert plain.shape[1] == clone.shape[1] == cont.shape[1] == 13
    assert plain.dtype == np.int64
    # the reference frames are in the clone and continuation prompts, verbatim
    for prompt in (clone, cont):
        rows = prompt[:, 1:]
        hits = [i for i in range(len(rows) - 4) if (rows[i:i + 5] == codes).all()]
        assert len(hits) == 1
    with pytest.raises(ValueError, match="ref_text"):
        variant.build_request(speech_job(ref_text="only text"))
    with pytest.raises(ValueError, match="one reference clip"):  # not the first of several, silently
        variant.build_request(speech_job(ref_codes=codes, extra_ref_codes=[codes]))


def test_sampling_overrides_and_caps(variant) -> None:
    s = variant.build_request(speech_job(sampling={"seed": 7, "top_k": 5, "temperature": 1,
                                            "max_new_frames": 10_000})).sampling
    assert (s.seed, s.top_k, s.temperature, s.max_new_frames) == (7, 5, 1.0, 100)
    assert s.top_p == 0.8  # model-card default kept
    with pytest.raises(ValueError, match="top_k"):
        variant.build_request(speech_job(sampling={"top_k": "many"}))
    with pytest.raises(ValueError, match="unknown sampling fields"):
        variant.build_request(speech_job(sampling={"beam": 4}))


def test_forced_length_from_text_and_per_job(variant) -> None:
    text = "x" * 40
    s = variant.build_request(speech_job(text=text)).sampling
    assert s.forced_frames == round(0.87 * 40)
    s = variant.build_request(speech_job(text=text, forced_frames=3)).sampling
    assert s.forced_frames == 3
    s = variant.build_request(speech_job(text=text, forced_frames=500)).sampling
    assert s.forced_frames == 500   # explicit: the frame cap ends it with "length"
    s = variant.build_request(speech_job(text="y" * 1000)).sampling
    assert s.forced_frames == 100   # capped by max_new_frames


def test_unknown_model_type_is_named(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "bark"}')
    with pytest.raises(UnknownModel, match="bark"):
        load_variant(tmp_path, load_profile("cpu"))
