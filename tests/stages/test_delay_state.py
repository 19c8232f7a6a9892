"""The Delay state machine walked over upstream's golden generations: forced text, sampled-channel
ranges and frame counts agree with what upstream `generate` produced row by row."""

import json

import numpy as np
import pytest

from stages.models.delay.config import DelayConfig
from stages.models.delay.state import INSIDE_AUDIO, OUTSIDE_AUDIO, DelayState
from tests.conftest import golden_dir

GOLDEN = golden_dir("moss_tts_delay")
CONFIG = DelayConfig.from_dict(json.loads((GOLDEN / "config.json").read_text()))


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / f"case_{name}.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("name", ["plain", "voice_clone", "continuation"])
def test_state_reproduces_every_golden_row(name):
    g = golden(name)
    state = DelayState.for_prompt(g["input_ids"][:, 0].tolist(), CONFIG)
    assert state.is_audio == (name == "continuation")
    for row in g["generated_rows"]:
        text, codes = int(row[0]), row[1:]
        rule = state.text_rule(CONFIG)
        if rule.forced is not None:
            assert text == rule.forced
        elif rule.mode == INSIDE_AUDIO:
            assert text in (CONFIG.gen_slot, CONFIG.delay_slot)
        else:
            assert text not in (CONFIG.pad_token_id, CONFIG.gen_slot, CONFIG.delay_slot, CONFIG.audio_end)
        lo, hi = state.audio_channels()
        sampled = np.zeros(CONFIG.n_vq, dtype=bool)
        sampled[lo:hi] = True
        np.testing.assert_array_equal(codes != CONFIG.audio_pad_code, sampled)
        state.advance(text, CONFIG)


def test_drain_and_block_end():
    s = DelayState(n_vq=4, audio_len=3, is_audio=True, step=10)
    s.advance(CONFIG.delay_slot, CONFIG)  # sampled first delay slot starts the drain
    seen = []
    while not s.block_complete:
        rule = s.text_rule(CONFIG)
        seen.append((rule.forced, s.audio_channels()))
        s.advance(rule.forced, CONFIG)
    # 3 more forced delay slots, each sampling one codebook fewer
    assert seen == [(CONFIG.delay_slot, (1, 4)), (CONFIG.delay_slot, (2, 4)), (CONFIG.delay_slot, (3, 4))]
    assert s.text_rule(CONFIG).forced == CONFIG.audio_end and s.audio_channels() == (4, 4)
    s.advance(CONFIG.audio_end, CONFIG)
    assert not s.is_audio and s.audio_len == 0 and s.delayed is None and s.text_rule(CONFIG).mode == OUTSIDE_AUDIO


def test_early_step_bans_and_length_override():
    s = DelayState(n_vq=4)
    rule = s.text_rule(CONFIG)
    assert rule.ban_delay_slot and rule.ban_im_end
    assert s.length_override(CONFIG, frame_limit=2, forced=True) == CONFIG.audio_start
    s.advance(CONFIG.audio_start, CONFIG)
    assert s.length_override(CONFIG, frame_limit=2, forced=True) == CONFIG.gen_slot
    s.advance(CONFIG.gen_slot, CONFIG)
    assert s.frames == 1
    assert s.length_override(CONFIG, frame_limit=2, forced=False) == CONFIG.delay_slot  # budget reached
    for _ in range(5):
        s.advance(CONFIG.delay_slot if s.text_rule(CONFIG).forced is None else s.text_rule(CONFIG).forced, CONFIG)
    assert s.step == 7 and not s.text_rule(CONFIG).ban_im_end  # im_end allowed after step n_vq
