"""`talker.priority_stream` and `codec.priority_stream`: the worker's work goes to a stream of the
highest priority (CUDA only)."""

import pytest
import torch

from profiles import load_profile
from stages.workers.common import use_priority_stream


def test_off_by_default_and_nothing_to_do_on_cpu():
    assert load_profile("high-concurrency").talker.priority_stream is False
    assert load_profile("high-concurrency").codec.priority_stream is False
    assert load_profile("cpu", ["talker.priority_stream=true"]).talker.priority_stream is True
    assert load_profile("cpu", ["codec.priority_stream=true"]).codec.priority_stream is True
    assert use_priority_stream("cpu") is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replays_on_the_priority_stream():
    before = torch.cuda.current_stream()
    try:
        assert use_priority_stream("cuda:0")
        stream = torch.cuda.current_stream()
        assert stream != before and stream.priority < before.priority
        x = torch.ones(8, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2
        x.fill_(3)
        g.replay()
        assert y.tolist() == [6.0] * 8
    finally:
        torch.cuda.set_stream(before)
