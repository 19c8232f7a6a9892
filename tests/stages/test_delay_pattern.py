"""Delay pattern: apply / whole de-delay / incremental de-delay agree with upstream's golden arrays."""


import numpy as np
import pytest

from stages.models.delay.delay_pattern import IncrementalDeDelayer, apply_delay_pattern, de_delay, is_pad_frame
from tests.conftest import golden_dir

GOLDEN = golden_dir("moss_tts_delay")
CASES = ["plain", "voice_clone", "continuation"]
PAD = 64


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / f"case_{name}.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("name", CASES)
def test_whole_de_delay_equals_upstream(name):
    g = golden(name)
    delayed = g["generation_ids"][:, 1:]
    np.testing.assert_array_equal(delayed, g["delayed_audio_codes"])
    frames = de_delay(delayed)
    np.testing.assert_array_equal(frames, g["de_delayed_audio_codes"])
    np.testing.assert_array_equal(is_pad_frame(frames, PAD), g["de_delayed_is_pad_row"])


@pytest.mark.parametrize("name", CASES)
def test_incremental_de_delay_equals_whole(name):
    g = golden(name)
    delayed = g["generation_ids"][:, 1:]
    n_vq = delayed.shape[1]
    dd = IncrementalDeDelayer(n_vq)
    emitted, emitted_at = [], []
    for r, row in enumerate(delayed):
        frame = dd.push(row)
        if frame is not None:
            emitted.append(frame)
            emitted_at.append(r)
    np.testing.assert_array_equal(np.stack(emitted), g["de_delayed_audio_codes"])
    # frame t is released by row t + n_vq - 1, the row that carries its last codebook
    assert emitted_at == [t + n_vq - 1 for t in range(len(emitted))]


def test_apply_then_de_delay_round_trips_and_matches_prompt_layout():
    g = golden("voice_clone")
    ref = g["reference_audio_codes"]  # [6, 32]
    delayed = apply_delay_pattern(ref, PAD)
    assert delayed.shape == (6 + 32 - 1, 32)
    np.testing.assert_array_equal(de_delay(delayed), ref)
    # in the golden prompt the user-slot rows carry exactly this delayed block
    slot_rows = g["input_ids"][g["input_ids"][:, 0] == 610]
    np.testing.assert_array_equal(slot_rows[:, 1:], delayed)
