"""The v1.5 prompt processor reproduces upstream's prompts on the golden cases exactly."""

import json
import numpy as np
import pytest

from stages.models.local_v15.config import LocalV15Config
from stages.models.local_v15.processor import LocalV15Processor
from tests.conftest import golden_case, golden_dir

GOLDEN = golden_dir("moss_tts_local_v1_5")
TARGET = "Hello world, this is a tiny golden test."


@pytest.fixture(scope="module")
def processor() -> LocalV15Processor:
    return LocalV15Processor.from_dir(GOLDEN)


@pytest.fixture(scope="module")
def cases() -> dict:
    return json.loads((GOLDEN / "cases.json").read_text())["cases"]


def golden(name: str) -> dict[str, np.ndarray]:
    return golden_case(GOLDEN, name)


def check_against_golden(processor, prompt: np.ndarray, name: str) -> None:
    g = golden(name)
    ids, mask = processor.pad_batch([prompt])
    assert ids.dtype == np.int64 and ids.shape == (1, *g["input_ids"].shape)
    np.testing.assert_array_equal(ids[0], g["input_ids"])
    np.testing.assert_array_equal(mask[0], g["attention_mask"])


def test_plain_case(processor, cases):
    msg = cases["plain"]["messages"][0]
    prompt = processor.build_prompt(msg["text"], language=msg["language"])
    assert prompt.shape[0] == cases["plain"]["prompt_len"]
    check_against_golden(processor, prompt, "plain")


def test_voice_clone_case(processor, cases):
    msg = cases["voice_clone"]["messages"][0]
    ref = golden("voice_clone")["reference_audio_codes"]
    prompt = processor.build_prompt(msg["text"], reference=[ref], language=msg["language"])
    check_against_golden(processor, prompt, "voice_clone")
    # the reference rows sit on the user slot id, wrapped by audio_start/audio_end, with no label
    ids = processor.config
    start = int(np.flatnonzero(prompt[:, 0] == ids.user_slot)[0])
    assert prompt[start - 1, 0] == ids.audio_start and prompt[start + ref.shape[0], 0] == ids.audio_end
    np.testing.assert_array_equal(prompt[start:start + ref.shape[0], 1:], ref)


def test_continuation_case(processor, cases):
    user = cases["continuation"]["messages"][0]
    assert user["text"] == "Reference words come first. " + TARGET
    codes = golden("continuation")["prompt_audio_codes"]
    prompt = processor.build_prompt(
        TARGET, prompt_codes=codes, prompt_text="Reference words come first. ", language=user["language"]
    )
    check_against_golden(processor, prompt, "continuation")
    ids = processor.config
    assert (prompt[-codes.shape[0]:, 0] == ids.gen_slot).all()
    assert ids.audio_end not in prompt[:, 0]


def test_pieces_are_tokenized_separately(processor):
    # joining the pieces first merges tokens at the seams ("test." + "\n</user_inst>"); upstream does not
    prompt = processor.build_prompt(TARGET, language="English")
    body = prompt[1:-6, 0].tolist()  # after im_start; before im_end "\n" im_start "assistant" "\n" audio_start
    assert processor.tokenizer.decode(body).endswith(TARGET + "\n</user_inst>")
    joined = processor.tokenizer.encode(processor.tokenizer.decode(body))
    assert joined != body


def test_fields_tokens_instruction_and_pause_pass_through(processor):
    text = "First part [pause 1.2s] second part."
    prompt = processor.build_prompt(text, language="French", tokens=42, instruction="  calm voice ")
    decoded = processor.tokenizer.decode(prompt[:, 0].tolist())
    assert "- Tokens:\n42\n" in decoded
    assert "- Instruction:\ncalm voice\n" in decoded  # stripped as upstream
    assert "- Language:\nFrench\n" in decoded
    assert "- Text:\nFirst part [pause 1.2s] second part.\n</user_inst>" in decoded
    assert (prompt[:, 1:] == processor.config.audio_pad_code).all()


def test_special_ids_come_from_config():
    config = json.loads((GOLDEN / "config.json").read_text())
    shifted = dict(config, audio_start_token_id=config["audio_end_token_id"])
    ids = LocalV15Config.from_dict(shifted)
    processor = LocalV15Processor(LocalV15Processor.from_dir(GOLDEN).tokenizer, ids)
    prompt = processor.build_prompt("x")
    assert prompt[-1, 0] == config["audio_end_token_id"]


def test_bad_shapes_and_combinations_are_rejected(processor):
    with pytest.raises(ValueError, match=r"\[T, 12\]"):
        processor.build_prompt("x", reference=[np.zeros((3, 4), dtype=np.int64)])
    with pytest.raises(ValueError):
        processor.build_prompt("x", prompt_text="transcript without codes")


def test_left_padding_of_a_batch(processor):
    short = processor.build_prompt("Hi.")
    long = processor.build_prompt(TARGET)
    ids, mask = processor.pad_batch([short, long])
    pad = long.shape[0] - short.shape[0]
    assert pad > 0 and ids.shape == (2, long.shape[0], 13)
    assert (ids[0, :pad, 0] == processor.config.pad_token_id).all() and not mask[0, :pad].any()
    assert (ids[0, :pad, 1:] == processor.config.audio_pad_code).all()
    np.testing.assert_array_equal(ids[0, pad:], short)
    assert mask[1].all()


def test_a_voice_reference_and_a_continuation_together(processor):
    ref = (np.arange(4 * 12).reshape(4, 12) % 64).astype(np.int64)
    spoken = (np.arange(3 * 12).reshape(3, 12) % 63).astype(np.int64)
    both = processor.build_prompt(TARGET, reference=[ref], prompt_codes=spoken, prompt_text="Said before. ")
    clone = processor.build_prompt("Said before. " + TARGET, reference=[ref])
    # the voice-clone prompt of the joined text, then the spoken codes on the assistant slot
    assert (both[: len(clone)] == clone).all() and len(both) == len(clone) + 3
    assert (both[-3:, 0] == processor.config.gen_slot).all() and (both[-3:, 1:] == spoken).all()
