"""Realtime runner: upstream greedy frames reproduced exactly, streaming from the first step, batching."""

import json

import numpy as np
import pytest

from speech.sampling import SamplingParams
from stages.models.realtime.processor import RealtimeProcessor
from stages.models.realtime.runner import RealtimeRunner
from tests.conftest import golden_dir

GOLDEN = golden_dir("moss_tts_realtime")
TEXT = json.loads((GOLDEN / "cases.json").read_text())["text"]


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / f"case_{name}.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def processor() -> RealtimeProcessor:
    return RealtimeProcessor.from_dir(GOLDEN)


@pytest.fixture(scope="module")
def runner() -> RealtimeRunner:
    return RealtimeRunner.from_dir(GOLDEN, max_running=4, num_kv_blocks=64, upstream_sampling=True)


def run(runner, items, max_steps=40):
    out = {rid: [] for rid, _, _ in items}
    first_step = {}
    for rid, prompt, params in items:
        runner.add(rid, prompt, params)
    for step in range(1, max_steps + 1):
        for e in runner.step():
            if e.codes is not None:
                out[e.rid].append(e.codes)
                first_step.setdefault(e.rid, step)
        if runner.num_running() == 0:
            break
    return {rid: np.stack(v) for rid, v in out.items()}, first_step


@pytest.mark.parametrize("name", ["plain", "voice_clone"])
@pytest.mark.parametrize("penalty,key", [(1.0, "generated_frames"), (1.1, "generated_frames_rep_penalty_1_1")])
def test_greedy_frames_equal_upstream(processor, runner, name, penalty, key):
    g = golden(name)
    prompt = processor.build_prompt(TEXT, reference=g.get("reference_audio_codes"))
    params = SamplingParams(greedy=True, temperature=0.0, repetition_penalty=penalty, max_new_frames=13)
    frames, first = run(runner, [(1, prompt, params)])
    np.testing.assert_array_equal(frames[1], g[key])
    assert first[1] == 1  # the prefill step already yields frame 0


def test_teacher_forced_rows_are_what_the_runner_feeds(processor):
    """Rows fed after prefill: [next text token or text_pad | previous frame] (golden tf_input_ids)."""
    g = golden("plain")
    runner = RealtimeRunner.from_dir(GOLDEN, max_running=2, num_kv_blocks=64, upstream_sampling=True)
    runner.add(3, processor.build_prompt(TEXT), SamplingParams(greedy=True, temperature=0.0, max_new_frames=100))
    for _ in range(12):
        runner.step()
    rows = runner.rows(3)
    np.testing.assert_array_equal(rows, g["tf_input_ids"][: len(rows)])


def test_batch_of_mixed_requests_equals_solo_runs(processor, runner):
    ref = golden("voice_clone")["reference_audio_codes"]
    items = [
        (1, processor.build_prompt(TEXT), SamplingParams(temperature=0.8, top_p=0.6, top_k=30,
                                                          repetition_penalty=1.1, seed=11, forced_frames=6)),
        (2, processor.build_prompt("Short one.", reference=ref),
         SamplingParams(temperature=0.8, top_p=0.6, top_k=30, repetition_penalty=1.1, seed=12, forced_frames=9)),
    ]
    together, _ = run(runner, items)
    for item in items:
        alone, _ = run(runner, [item])
        np.testing.assert_array_equal(together[item[0]], alone[item[0]])
    assert len(together[1]) == 6 and len(together[2]) == 9
    assert max(f.max() for f in together.values()) < 1024  # forced mode bans pad/BOS/EOS ids


def test_audio_eos_in_codebook_0_stops_and_max_new_frames_is_length(processor):
    import torch

    runner = RealtimeRunner.from_dir(GOLDEN, max_running=2, num_kv_blocks=64, upstream_sampling=True)
    prompt = processor.build_prompt(TEXT)
    runner.add(1, prompt, SamplingParams(greedy=True, temperature=0.0, max_new_frames=3))
    events = [e for _ in range(5) for e in runner.step()]
    assert [e.finished for e in events] == [False, False, True] and events[-1].reason == "length"

    local = runner.model.local_transformer
    eos_head = torch.nn.Linear(local.local_lm_heads[0].in_features, 1027, bias=True)
    with torch.no_grad():
        eos_head.weight.zero_()
        eos_head.bias.zero_()
        eos_head.bias[1026] = 1.0
    local.local_lm_heads[0] = eos_head
    runner.add(2, prompt, SamplingParams(greedy=True, temperature=0.0, max_new_frames=10))
    events = runner.step()
    assert len(events) == 1 and events[0].codes is None and events[0].finished and events[0].reason == "stop"
    assert runner.num_running() == 0


def test_text_fed_while_it_speaks_gives_the_upstream_frames(processor):
    """The request opens with its first 12 tokens; the last two come one by one, some idle steps
    after it paused for each; then the final feed. The frames are upstream's, with pauses."""
    g = golden("plain")
    ids = processor.text_ids(TEXT)
    assert len(ids) == 14
    runner = RealtimeRunner.from_dir(GOLDEN, max_running=2, num_kv_blocks=64, upstream_sampling=True)
    params = SamplingParams(greedy=True, temperature=0.0, repetition_penalty=1.1, max_new_frames=13)
    runner.add(7, processor.prompt_of_ids(ids[:12]), params)
    runner.open_input(7)
    frames, paused_after, todo = [], [], [[ids[12]], [ids[13]], []]
    idle = 0
    for _ in range(60):
        events = runner.step()
        if not events and todo:
            idle += 1
            if idle > 2:  # steps while it waits make nothing
                runner.feed(7, processor.text_rows(todo.pop(0)), final=not todo)
                idle = 0
        for e in events:
            frames.append(e.codes)
            if e.paused:
                paused_after.append(len(frames))
        if runner.num_running() == 0:
            break
    # the prefill frame needs no new text; each later frame takes one token: it pauses after
    # frame 1 (no token left), then after frame 2, and with the final feed it runs to the end
    assert paused_after == [1, 2, 3]
    np.testing.assert_array_equal(np.stack(frames), g["generated_frames_rep_penalty_1_1"])
