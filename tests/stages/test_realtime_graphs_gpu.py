"""Realtime depth-loop graphs on CUDA, full-size network with random weights (bf16): recorded graphs
give the tokens of the same padded inputs run eagerly, and the per-step time with graphs against
the eager loop ("off") at batch 1 and 16 is printed (`pytest -s` shows it)."""

import time

import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from stages.models.realtime.config import RealtimeConfig, full_size_config
from stages.models.realtime.model import RealtimeModel
from stages.models.realtime.runner import RealtimeRunner
from stages.runtime.attention.backends import make_attention
from tests.stages.runner_drive import drive

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model() -> RealtimeModel:
    """Full-size shapes, seeded random weights (norm weights 1, the rest N(0, 0.02))."""
    with torch.device("meta"):
        model = RealtimeModel(RealtimeConfig.from_dict(full_size_config()))
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02, generator=gen)
    return model.zero_padding_rows_().eval()


def prompt(cfg: RealtimeConfig, seed: int, text: int = 30, prefill: int = 40) -> np.ndarray:
    """Prefill rows (random text ids, audio pad), the audio BOS row, then `text` ids to stream."""
    rng = np.random.default_rng(seed)
    rows = np.full((prefill + 1 + text, 1 + cfg.rvq), cfg.audio_pad, dtype=np.int64)
    rows[:, 0] = rng.integers(0, 150000, len(rows))
    rows[prefill, 1:] = cfg.audio_bos
    return rows


def runner_of(model, graph_path: str, max_running: int = 16) -> RealtimeRunner:
    return RealtimeRunner(model, max_running=max_running, num_kv_blocks=max_running * 16,
                          attention=make_attention("auto", "cuda"), graph_path=graph_path)


def params(seed: int, frames: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.6, top_k=30, repetition_penalty=1.1, seed=seed,
                          forced_frames=frames)


def test_recorded_graphs_give_the_eager_graph_paths_tokens(model):
    """Five requests arriving at different steps (buckets 1, 2, 4, 8 and shrinking as they end)."""
    cfg = model.config
    arrivals = {0: [(1, prompt(cfg, 1), params(1, 30))], 3: [(2, prompt(cfg, 2), params(2, 20))],
                5: [(3, prompt(cfg, 3), params(3, 25)), (4, prompt(cfg, 4), params(4, 60))],
                8: [(5, prompt(cfg, 5), params(5, 12))]}
    eager = drive(runner_of(model, "eager"), arrivals)
    graphed_runner = runner_of(model, "cuda")
    graphed = drive(graphed_runner, arrivals)
    assert graphed_runner.depth_graphs.capture and len(graphed_runner.depth_graphs.keys) >= 3
    for rid in eager:
        np.testing.assert_array_equal(graphed[rid], eager[rid])


def median_step_ms(runner: RealtimeRunner, cfg: RealtimeConfig, batch: int, frames: int = 40) -> float:
    """Median time of the steps where every request decodes (after the prefill step)."""
    for rid in range(batch):
        runner.add(rid, prompt(cfg, rid), params(rid, frames))
    times = []
    while runner.num_running():
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.step()  # ends with the step's one device-to-host copy
        times.append(time.perf_counter() - t)
    steady = sorted(times[2:])
    return steady[len(steady) // 2] * 1e3


@pytest.mark.parametrize("batch", [1, 16])
def test_step_time_with_graphs_against_the_eager_loop(model, batch):
    cfg = model.config
    result = {}
    for path in ("off", "cuda"):
        runner = runner_of(model, path, max_running=batch)
        runner.capture_ahead(120.0)  # depth graphs ahead; the backbone's on first use (this warm-up)
        median_step_ms(runner, cfg, batch, frames=4)
        result[path] = median_step_ms(runner, cfg, batch)
    print(f"\nrealtime full size, batch {batch}: median step {result['off']:.1f} ms eager loop, "
          f"{result['cuda']:.1f} ms with graphs (real time: < 80 ms)")
    assert result["cuda"] < result["off"]
