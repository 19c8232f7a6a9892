"""Delay runner: upstream greedy generation reproduced exactly, streaming frames, batching, budgets."""


import numpy as np
import pytest

from speech.sampling import SamplingParams
from stages.models.delay.delay_pattern import de_delay, is_pad_frame
from stages.models.delay.model import DelayModel
from stages.models.delay.runner import DelayRunner
from tests.conftest import golden_dir

GOLDEN = golden_dir("moss_tts_delay")
GREEDY = SamplingParams(greedy=True, temperature=0.0, text_temperature=0.0, max_new_frames=1000)


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / f"case_{name}.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def runner_upstream() -> DelayRunner:
    return DelayRunner.from_dir(GOLDEN, max_running=4, num_kv_blocks=64, finish_on_audio_end=False)


@pytest.mark.parametrize("name", ["plain", "voice_clone", "continuation"])
def test_greedy_48_steps_equal_upstream_generation(runner_upstream, name):
    g = golden(name)
    runner_upstream.add(7, g["input_ids"], GREEDY)
    events = [runner_upstream.step() for _ in range(48)]
    rows = runner_upstream.rows(7)
    runner_upstream.remove(7)
    np.testing.assert_array_equal(rows[-48:], g["generated_rows"])
    # frames stream out as they complete and equal upstream's de-delayed non-pad frames of block 1
    frames = [e.codes for step in events for e in step if e.codes is not None]
    dd = g["de_delayed_audio_codes"]
    pad = is_pad_frame(dd, 64)
    first_block = dd[np.flatnonzero(~pad)[0]:]
    first_block = first_block[: np.argmax(is_pad_frame(first_block, 64))] if is_pad_frame(first_block, 64).any() \
        else first_block
    start = int(g["generation_start_length"]) - 1 if name == "continuation" else 0  # prompt frames are not re-emitted
    np.testing.assert_array_equal(np.stack(frames)[: len(first_block) - start], first_block[start:])


def test_first_frame_after_n_vq_plus_one_steps_and_finish_after_drain():
    g = golden("plain")
    runner = DelayRunner.from_dir(GOLDEN, max_running=2, num_kv_blocks=64)
    runner.add(1, g["input_ids"], GREEDY)
    step_of_frame, finished_at, reason = [], None, None
    for step in range(1, 60):
        for e in runner.step():
            if e.codes is not None:
                step_of_frame.append(step)
            if e.finished:
                finished_at, reason = step, e.reason
        if finished_at:
            break
    n_vq = 32
    assert step_of_frame[0] == n_vq + 1  # audio_start, then n_vq rows until frame 0's last codebook
    assert step_of_frame == list(range(n_vq + 1, n_vq + 1 + 9))  # one frame per step after that
    assert finished_at == step_of_frame[-1] and reason == "stop"  # no extra audio_end step
    assert runner.num_running() == 0
    # the 9 streamed frames are upstream's 9 non-pad de-delayed frames
    dd = de_delay(g["generation_ids"][:, 1:])
    assert len(step_of_frame) == (~is_pad_frame(dd, 64)).sum() == 9


def test_batched_requests_equal_solo_runs_and_forced_length():
    """Sampled (not greedy) requests in one batch give the same frames as alone; forced_frames holds."""
    p1 = golden("plain")["input_ids"]
    p2 = golden("voice_clone")["input_ids"]
    params = [SamplingParams(temperature=1.0, top_k=10, top_p=0.9, repetition_penalty=1.2, text_temperature=1.0,
                             seed=s, forced_frames=f) for s, f in ((3, 5), (4, 3))]

    def run(items):
        runner = DelayRunner.from_dir(GOLDEN, max_running=4, num_kv_blocks=64, prefill_chunk_tokens=40)
        for rid, prompt, sp in items:
            runner.add(rid, prompt, sp)
        out = {rid: [] for rid, _, _ in items}
        done = {}
        for _ in range(80):
            for e in runner.step():
                if e.codes is not None:
                    out[e.rid].append(e.codes)
                if e.finished:
                    done[e.rid] = e.reason
            if runner.num_running() == 0:
                break
        return out, done

    together, done = run([(1, p1, params[0]), (2, p2, params[1])])
    alone1, _ = run([(1, p1, params[0])])
    alone2, _ = run([(2, p2, params[1])])
    assert done == {1: "stop", 2: "stop"}
    assert len(together[1]) == 5 and len(together[2]) == 3
    np.testing.assert_array_equal(np.stack(together[1]), np.stack(alone1[1]))
    np.testing.assert_array_equal(np.stack(together[2]), np.stack(alone2[2]))
    assert all((f < 64).all() for f in together[1] + together[2])


def test_max_new_frames_finishes_with_length():
    runner = DelayRunner.from_dir(GOLDEN, max_running=2, num_kv_blocks=64)
    params = SamplingParams(greedy=True, temperature=0.0, text_temperature=0.0, max_new_frames=4)
    runner.add(5, golden("voice_clone")["input_ids"], params)
    frames, last = 0, None
    while runner.num_running():
        for e in runner.step():
            frames += e.codes is not None
            last = e
    assert frames == 4 and last.finished and last.reason == "length"


def test_sixteen_codebook_variant_streams_after_n_vq_plus_one_steps():
    """TTSD / SoundEffect / VoiceGenerator shape (n_vq 16), tiny random weights, forced length."""
    import torch

    from stages.models.delay.config import DelayConfig, tiny_config
    from stages.models.delay.processor import DelayProcessor
    from stages.runtime.tokenizer import TextTokenizer

    torch.manual_seed(0)
    config = DelayConfig.from_dict(tiny_config(n_vq=16))
    model = DelayModel(config).fuse_().eval()
    prompt = DelayProcessor(TextTokenizer.from_dir(GOLDEN), config).build_prompt("Rain on a roof.")
    runner = DelayRunner(model, max_running=2, num_kv_blocks=32)
    runner.add(9, prompt, SamplingParams(seed=1, forced_frames=3, max_new_frames=100))
    frame_steps, finished = [], None
    for step in range(1, 40):
        for e in runner.step():
            if e.codes is not None:
                frame_steps.append(step)
                assert e.codes.shape == (16,) and (e.codes < 1024).all()
            if e.finished:
                finished = (step, e.reason)
        if finished:
            break
    assert frame_steps == [17, 18, 19] and finished == (19, "stop")


def test_preempted_request_resumes_exactly():
    """A KV pool too small for both requests: the newer one is preempted (blocks freed), prefilled
    again later from its prompt + generated rows, and still yields the frames it yields alone."""
    prompts = {1: golden("plain")["input_ids"], 2: golden("voice_clone")["input_ids"]}
    params = {rid: SamplingParams(temperature=1.0, top_k=20, top_p=0.95, text_temperature=1.0, seed=rid,
                                  forced_frames=6) for rid in prompts}

    def run(rids, blocks):
        runner = DelayRunner.from_dir(GOLDEN, max_running=2, num_kv_blocks=blocks)
        for rid in rids:
            runner.add(rid, prompts[rid], params[rid])
        out = {rid: [] for rid in rids}
        freed = []
        free = runner.scheduler.cache.free
        runner.scheduler.cache.free = lambda rid: (freed.append((rid, rid in runner.scheduler.requests)), free(rid))
        for _ in range(200):
            for e in runner.step():
                if e.codes is not None:
                    out[e.rid].append(e.codes)
            if runner.num_running() == 0:
                break
        preempted = any(still_running for _, still_running in freed)  # freed while not finished
        return {rid: np.stack(v) for rid, v in out.items()}, preempted

    together, preempted = run([1, 2], blocks=13)  # at their longest they need 7 + 9 blocks of 16
    assert preempted
    for rid in prompts:
        alone, _ = run([rid], blocks=64)
        np.testing.assert_array_equal(together[rid], alone[rid])


def test_im_end_is_banned_until_step_n_vq_then_stops_the_request():
    """A text head that always prefers im_end (then a plain text id): upstream bans im_end while
    step <= n_vq, so the request writes text for n_vq + 1 steps and stops at the next one."""
    import torch

    runner = DelayRunner.from_dir(GOLDEN, max_running=2, num_kv_blocks=64)
    cfg = runner.config
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[cfg.im_end] = 10.0
        head.bias[100] = 5.0
    runner.model.lm_heads[0] = head
    runner.add(4, golden("plain")["input_ids"], GREEDY)
    events = []
    for step in range(1, 40):
        events += [(step, e) for e in runner.step()]
        if runner.num_running() == 0:
            break
    assert [(s, e.codes, e.finished, e.reason) for s, e in events] == [(cfg.n_vq + 2, None, True, "stop")]
