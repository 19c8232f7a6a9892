"""A worker's start-up log (`stages.workers.startup`, `graph_capture.CaptureProgress`): each
torch.compile compile is one line naming what the worker was doing and why it compiled again, its
time goes to the compile phase (out of the span it ran in), the phases add up to the total, and
graph captures report a line at each tenth and one for the whole, their count known before the
first capture."""

import pytest
import torch

from bench.codec import random_codec
from stages.models.codec.config import CodecConfig, tiny_v2_config
from stages.models.codec.runner import CodecRunner
from stages.runtime.graph_capture import CaptureProgress, make_missing
from stages.workers.codec import WARM_ENCODE_FRAMES, warm_up
from stages.workers.startup import StartupLog, describe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def adds_up(times) -> bool:
    return abs(times.total - (times.start + times.load + times.compile + times.capture + times.warm_up)) < 1e-9


def test_each_compile_is_a_line_and_its_time_leaves_the_span_it_ran_in():
    def doubled_sine(x):
        return torch.sin(x) * 2

    def halved_cosine(x):
        return torch.cos(x) / 2

    compiled = torch.compile(doubled_sine, backend="eager", dynamic=True)
    other = torch.compile(halved_cosine, backend="eager", dynamic=True)
    lines: list[str] = []
    startup = StartupLog("talker", lines.append)
    try:
        with startup.phase("warm-up", "warm-up batch 1 of 2 (alone)") as alone:
            compiled(torch.ones(1))  # torch specialises a size of 1
        assert len(lines) == 1  # at the span's end
        with startup.phase("warm-up", "warm-up batch 2 of 2 (two)") as two:
            compiled(torch.ones(2))  # the shape-generic graph ...
            compiled(torch.ones(3))  # ... which serves this one too
            assert len(lines) == 1
            other(torch.ones(2))
            assert len(lines) == 2  # the compile before came out as this one began
        times = startup.times()
    finally:
        startup.close()
    assert len(lines) == 3
    assert lines[0].startswith("talker: compile 1: doubled_sine in ")
    assert lines[0].endswith("s, during warm-up batch 1 of 2 (alone)")
    assert lines[1].startswith("talker: compile 2: doubled_sine in ")
    assert "during warm-up batch 2 of 2 (two); again: " in lines[1]  # dynamo's reason follows
    assert lines[2].startswith("talker: compile 3: halved_cosine in ")
    assert (alone.compiles, two.compiles, times.compiles) == (1, 2, 3)
    assert times.compile == pytest.approx(alone.compile_seconds + two.compile_seconds)
    assert times.warm_up == pytest.approx(alone.seconds + two.seconds - times.compile)
    assert adds_up(times) and times.start >= 0
    assert describe(times).startswith(f"{times.total:.1f} s: start ")


def test_captures_report_each_tenth_then_the_whole():
    """The codec's warm-up on its eager graph path: the decode graphs of 4 batch buckets x 5 chunk
    lengths (the first decode made one), planned before the first is made, reported as they go."""
    model = random_codec(CodecConfig.from_json(tiny_v2_config()), "cpu", torch.float32, seed=3)
    runner = CodecRunner(model, n_vq=12, max_slots=6, graphs_eager=True, encode_graphs_eager=True, encode_batch=2)
    lines: list[str] = []
    startup = StartupLog("codec", lines.append)
    try:
        warm_up(runner, (1, 2, 4, 8, 15), max_batch=6, startup=startup)
        times = startup.times()
    finally:
        startup.close()
    decode = [line for line in lines if line.startswith("codec: decode graphs: ")]
    made = len(runner.graphs.keys) - 1  # buckets 1, 2, 4, 6 x 5 lengths, less the first decode's
    assert made == 19
    assert decode[-1].startswith(f"codec: decode graphs: captured {made} of {made} in ")
    counts = [int(line.split(": ")[2].split(" of ")[0]) for line in decode[:-1]]
    assert counts == sorted(counts) and 5 <= len(counts) <= 10  # about a tenth each, never a flood
    assert all(f" of {made} (" in line for line in decode[:-1])
    encode = [line for line in lines if line.startswith("codec: reference-encode graphs: captured ")]
    assert len(encode) == 1
    ahead = int(encode[0].split("captured ")[1].split(" of ")[0])
    assert times.graphs == made + ahead
    # the rest were recorded by the warm-up's reference encodes (a bucket each at most)
    assert 1 <= len(runner.encode_graphs.keys) - ahead <= len(WARM_ENCODE_FRAMES)
    assert times.capture > 0 and adds_up(times)


def test_planning_makes_nothing_and_a_spent_budget_is_said():
    made: dict[int, bool] = {}
    lines: list[str] = []
    progress = CaptureProgress("talker: decode graphs", lines.append)

    def capture(p: CaptureProgress, budget_s: float | None = None) -> int:
        return make_missing(range(25), made, lambda key: made.__setitem__(key, True), budget_s, p)

    assert progress.plan(capture) == 25 and not made and not lines
    assert capture(progress, budget_s=-1.0) == 0  # the budget already spent: none made
    progress.finish()
    assert lines == [lines[0]] and lines[0].startswith("talker: decode graphs: captured 0 of 25 in ")
    assert lines[0].endswith("(the time budget ran out: the rest when first needed)")


def test_a_record_of_no_frame_is_not_a_compile():
    """Dynamo also keeps records that name no frame (on a GPU one followed most compiles, 0.0 s):
    they are neither a line nor counted."""
    from types import SimpleNamespace

    from stages.workers.startup import CompileLog

    lines: list[str] = []
    compiles = CompileLog("talker", lines.append)
    compiles._log(SimpleNamespace(co_name="decode_frame", entire_frame_compile_time_s=2.0))
    compiles._log(SimpleNamespace(co_name=None, entire_frame_compile_time_s=0.0))
    assert (compiles.count, compiles.seconds) == (1, 2.0)
    assert lines == ["talker: compile 1: decode_frame in 2.0 s, during start-up"]
