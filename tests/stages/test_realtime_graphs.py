"""Realtime depth-loop graphs (`stages.models.realtime.graphs.DepthGraphs`) on the CPU through the
graph path's eager mode: the padded static-input path gives the frames of the eager loop ("off")
for seeded requests alone and in batches padded to buckets, with text that pauses the request;
padding rows touch only the scratch slot; a re-run of the body (as a capture does) changes nothing."""

import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from stages.models.realtime.config import RealtimeConfig, tiny_config
from stages.models.realtime.model import RealtimeModel
from stages.models.realtime.runner import RealtimeRunner
from stages.runtime.attention.backends import PaddedBatchAttention
from tests.stages.runner_drive import drive

MAX_RUNNING = 8  # buckets 1, 2, 4, 8


@pytest.fixture(scope="module")
def model() -> RealtimeModel:
    """The tiny Realtime network with seeded random weights; heads scaled up so that scores
    spread out and the repetition penalty and top-k / top-p change what is drawn."""
    torch.manual_seed(0)
    model = RealtimeModel(RealtimeConfig.from_dict(tiny_config())).zero_padding_rows_().eval()
    with torch.no_grad():
        for head in model.local_transformer.local_lm_heads:
            head.weight.mul_(30.0)
    return model


def prompt(cfg, seed: int, text: int = 5, prefill: int = 14) -> np.ndarray:
    """Prefill rows (random text ids, audio pad), the audio BOS row, then `text` ids to stream."""
    rng = np.random.default_rng(seed)
    rows = np.full((prefill + 1 + text, 1 + cfg.rvq), cfg.audio_pad, dtype=np.int64)
    rows[:, 0] = rng.integers(0, 600, len(rows))
    rows[prefill, 1:] = cfg.audio_bos
    return rows


PARAMS = [
    SamplingParams(temperature=0.8, top_k=30, top_p=0.6, repetition_penalty=1.1, seed=11, forced_frames=9),
    SamplingParams(temperature=1.0, top_k=5, repetition_penalty=2.0, seed=12, forced_frames=60),  # window wraps
    SamplingParams(greedy=True, temperature=0.0, repetition_penalty=1.3, max_new_frames=7),
    SamplingParams(temperature=0.7, top_p=0.9, seed=14, forced_frames=5),
    SamplingParams(temperature=1.2, top_k=50, repetition_penalty=1.5, seed=15, max_new_frames=11),
]


def runner_of(model, graph_path: str) -> RealtimeRunner:
    return RealtimeRunner(model, max_running=MAX_RUNNING, num_kv_blocks=96, attention=PaddedBatchAttention(),
                          graph_path=graph_path)


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_eager_graph_path_gives_the_eager_loops_frames(model, batch):
    """`batch` requests together (3 and 5 padded to buckets of 4 and 8, then fewer as they end)."""
    items = [(rid, prompt(model.config, rid), PARAMS[rid]) for rid in range(batch)]
    plain = drive(runner_of(model, "off"), {0: items})
    graphed_runner = runner_of(model, "eager")
    graphed = drive(graphed_runner, {0: items})
    assert set(graphed_runner.depth_graphs.keys) >= {1 << (batch - 1).bit_length()}
    for rid, _, params in items:
        expected = params.forced_frames or params.max_new_frames
        assert len(plain[rid]) == expected
        np.testing.assert_array_equal(graphed[rid], plain[rid])


def test_requests_arriving_mid_decode_get_the_frames_they_get_alone(model):
    arrivals = {0: [(0, prompt(model.config, 0), PARAMS[0])], 2: [(1, prompt(model.config, 1), PARAMS[1])],
                3: [(2, prompt(model.config, 2), PARAMS[2]), (3, prompt(model.config, 3), PARAMS[3])],
                6: [(4, prompt(model.config, 4), PARAMS[4])]}
    graphed = drive(runner_of(model, "eager"), arrivals)
    for items in arrivals.values():
        for rid, rows, params in items:
            alone = drive(runner_of(model, "off"), {0: [(rid, rows, params)]})
            np.testing.assert_array_equal(graphed[rid], alone[rid])


def run_with_pauses(runner: RealtimeRunner, cfg) -> tuple[dict[int, list[np.ndarray]], int]:
    """Request 0 opens with 2 text ids and gets 3 more, one at a time, each two steps after it
    paused (the last one final); requests 1 and 2 run beside it. Every request's frames, and how
    often request 0 paused."""
    later = prompt(cfg, 21, text=3)[-3:]  # rows whose column 0 is the next text id
    feeds = [later[i : i + 1] for i in range(3)]
    runner.add(0, prompt(cfg, 20, text=2), PARAMS[4])
    runner.open_input(0)
    runner.add(1, prompt(cfg, 1), PARAMS[1])
    runner.add(2, prompt(cfg, 2), PARAMS[0])
    out: dict[int, list[np.ndarray]] = {0: [], 1: [], 2: []}
    pauses, waited = 0, None  # steps since request 0 paused (None: not paused)
    for _ in range(200):
        for e in runner.step():
            if e.codes is not None:
                out[e.rid].append(e.codes)
            if e.rid == 0 and e.paused:
                pauses, waited = pauses + 1, 0
        if waited is not None:
            waited += 1
            if waited == 2:
                runner.feed(0, feeds.pop(0), final=not feeds)
                waited = None
        if runner.num_running() == 0:
            break
    return out, pauses


def test_a_request_paused_for_text_gets_the_same_frames_on_both_paths(model):
    plain, paused = run_with_pauses(runner_of(model, "off"), model.config)
    graphed, paused_graphed = run_with_pauses(runner_of(model, "eager"), model.config)
    assert paused == paused_graphed == 3
    for rid in plain:
        assert len(plain[rid]) > 0
        np.testing.assert_array_equal(np.stack(graphed[rid]), np.stack(plain[rid]))


def test_padding_rows_never_change_a_real_slots_history(model):
    """Three requests in a bucket of four: each request slot's history (and that of the slots no
    request holds) is the eager loop's; only the scratch slot differs."""

    def run(graph_path):
        runner = runner_of(model, graph_path)
        for rid in range(3):
            runner.add(rid, prompt(model.config, rid), PARAMS[rid])
        for _ in range(4):
            runner.step()
        return runner

    plain, graphed = run("off"), run("eager")
    assert graphed.depth_graphs.keys == [4]
    scratch = graphed.scratch
    assert scratch == MAX_RUNNING and scratch not in {r.sched.slot for r in graphed._requests.values()}
    torch.testing.assert_close(graphed.history[:scratch], plain.history[:scratch], rtol=0, atol=0)
    assert (graphed.history[scratch] != model.config.audio_vocab_size).any()  # the padding row wrote there


def test_a_rerun_of_the_depth_body_gives_the_same_codes(model):
    """A capture runs the body twice on the same inputs (warm-up, then the first replay): the
    history entry the first run writes must not change what the second draws."""
    runner = runner_of(model, "off")
    for rid in range(3):
        runner.add(rid, prompt(model.config, rid), PARAMS[1])  # a strong penalty
    for _ in range(5):
        runner.step()
    torch.manual_seed(1)
    h = torch.randn(3, model.config.hidden_size)
    slots = torch.tensor([r.sched.slot for r in runner._requests.values()])
    frames = torch.tensor([r.frames for r in runner._requests.values()])
    with torch.inference_mode():
        (first,) = runner._depth(h, slots, frames, slots)
        first = first.clone()
        (second,) = runner._depth(h, slots, frames, slots)
    torch.testing.assert_close(second, first, rtol=0, atol=0)


def test_capture_ahead_makes_every_batch_bucket():
    torch.manual_seed(0)
    model = RealtimeModel(RealtimeConfig.from_dict(tiny_config())).eval()
    runner = RealtimeRunner(model, max_running=6, num_kv_blocks=16, graph_path="cuda")  # CPU: eager
    assert runner.backbone_graph_path == "eager" and not runner.depth_graphs.capture
    assert runner.capture_ahead(10.0) == 4 and sorted(runner.depth_graphs.keys) == [1, 2, 4, 6]
    assert runner.capture_ahead(10.0) == 0
    assert RealtimeRunner(model, max_running=6, num_kv_blocks=16).capture_ahead(10.0) == 0  # "off": none


@pytest.mark.parametrize("graph_path", ["off", "eager"])
def test_without_a_forced_length_every_emitted_frame_is_decodable(model, graph_path):
    """Random weights with no forced length (the `default` profile's way): the heads span 1027
    ids, and pad, BOS and (beyond codebook 0) EOS are never drawn, so the codec can decode every
    frame; codebook 0 may still end a request with EOS (that frame is not emitted)."""
    params = [SamplingParams(temperature=1.0, top_k=50, repetition_penalty=1.1, seed=seed, max_new_frames=40)
              for seed in range(1, 6)]
    items = [(rid, prompt(model.config, 30 + rid), p) for rid, p in enumerate(params)]
    frames = drive(runner_of(model, graph_path), {0: items})
    emitted = np.concatenate([np.reshape(f, (-1, model.config.rvq)) for f in frames.values()])  # [frames, 16]
    assert len(emitted) >= 40
    assert emitted.min() >= 0 and emitted.max() < model.config.audio_pad, np.argwhere(emitted >= model.config.audio_pad)
