"""Realtime's text while it speaks: however the text is split, the request and the rows fed after
it carry exactly the ids of the whole text, and the request starts once 12 tokens are there."""

from __future__ import annotations

import random

import numpy as np
import pytest

from profiles import load_profile
from stages.models.realtime.text_stream import stable_cut
from stages.models.realtime.variant import RealtimeVariant
from stages.tools.make_checkpoint import make_checkpoint
from stages.variant import AdapterError
from tests.conftest import golden_dir, speech_job

TEXTS = [
    "MOSS TTS Realtime turns text into speech while the text is still arriving.",
    "Don't stop: it's 3.14 p.m., isn't it?!  Two  spaces,\nnew lines\n\nand (brackets) \"quotes\"...",
    "你好，世界。今天天气很好！We mix 中文 and English, 123 numbers; naïve café — done.",
]


@pytest.fixture(scope="module", params=["golden", "stand-in"])
def variant(request, tmp_path_factory):
    if request.param == "golden":  # its tokenizer, beside the golden v1 codec
        profile = load_profile("cpu", overrides=[f"model.codec_path={golden_dir('moss_audio_tokenizer_v1')}"])
        return RealtimeVariant(golden_dir("moss_tts_realtime"), profile)
    # the tokenizer make-checkpoint writes (what the served tiny checkpoints use)
    model_dir = tmp_path_factory.mktemp("rt")
    make_checkpoint(model_dir, variant="realtime", size="tiny", seed=1)
    return RealtimeVariant(model_dir, load_profile("cpu"))


def streamed_ids(variant, text: str, pieces: list[int]) -> tuple[np.ndarray, list[int]]:
    stream = variant.open_text_stream(speech_job(""))
    at, request, fed = 0, None, []
    for size in pieces + [len(text)]:
        stream.push(text[at:at + size])
        at += size
        request = request or stream.request()
        if request is not None:
            fed += [int(t) for t in stream.take_rows()[:, 0]]
    stream.end()
    request = request or stream.request()
    fed += [int(t) for t in stream.take_rows()[:, 0]]
    assert stream.text == text
    return request.prompt, fed


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_carry_the_ids_of_the_whole_text(variant, text):
    whole = variant.build_request(speech_job(text)).prompt  # prefill rows + the tokens to stream
    rng = random.Random(len(text))
    for _ in range(12):
        pieces = [rng.randint(1, 5) for _ in range(len(text))]
        prompt, fed = streamed_ids(variant, text, pieces)
        assert len(prompt) <= len(whole)
        np.testing.assert_array_equal(prompt, whole[: len(prompt)])  # the same prefill, BOS included
        assert [int(t) for t in whole[len(prompt):, 0]] == fed  # and the rest, fed in order


def test_the_request_waits_for_twelve_tokens_or_the_end(variant):
    stream = variant.open_text_stream(speech_job(""))
    stream.push("Hi ")
    assert stream.request() is None
    stream.end()
    request = stream.request()
    assert request is not None and stream.request() is None  # once only
    assert (request.prompt == variant.build_request(speech_job("Hi ")).prompt).all()
    long = variant.open_text_stream(speech_job(""))
    long.push(TEXTS[0])
    assert long.request() is not None  # 12 tokens are there before the end


def test_stable_cut():
    assert stable_cut("Hello wor") == 5 and stable_cut("Hello, wor") == 5
    assert stable_cut("Hello") == 0 and stable_cut("  ") == 0
    assert stable_cut("cafe\u0301 x") == 0  # never between "e" and its combining accent


def test_a_long_word_a_character_at_a_time_costs_linear_time(variant):
    """No boundary in 30 000 characters sent one by one: each push looks at the new text only
    (a rescan of everything not yet tokenized, per push, would take minutes here)."""
    import time

    text = "An " + "x" * 30_000 + " done, and a few words more to make twelve tokens."
    started = time.perf_counter()
    prompt, fed = streamed_ids(variant, text, [1] * len(text))
    assert time.perf_counter() - started < 5.0
    whole = variant.build_request(speech_job(text)).prompt
    np.testing.assert_array_equal(prompt, whole[: len(prompt)])  # still the whole text's ids
    assert [int(t) for t in whole[len(prompt):, 0]] == fed


def test_fields_it_does_not_use_change_nothing_and_several_references_are_refused(variant):
    """As for whole texts: ref_text, instructions and language are ignored (the API reports
    them), the reference is used, and several reference clips are wrong rather than unused."""
    ref = np.random.default_rng(0).integers(0, 1024, size=(20, 16), dtype=np.int64)
    unused = dict(ref_text="the reference words", instructions="a calm voice", language="English")
    prompts = []
    for fields in ({"ref_codes": ref, **unused}, {"ref_codes": ref}, {}):
        stream = variant.open_text_stream(speech_job("", **fields))
        stream.push(TEXTS[0])
        stream.end()
        prompts.append(stream.request().prompt)
    np.testing.assert_array_equal(prompts[0], prompts[1])
    assert prompts[1].shape != prompts[2].shape  # the reference is the voice-context block
    with pytest.raises(AdapterError, match="one reference clip"):
        variant.open_text_stream(speech_job("", ref_codes=ref, extra_ref_codes=[ref]))
