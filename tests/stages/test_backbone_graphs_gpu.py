"""Backbone CUDA graphs of the Delay and Realtime runners on a GPU (decode rows, and prompt chunks
with prefill graphs): frames replayed from captured graphs equal the one-call step's (tiny random checkpoints written here, fp32, sampled requests
arriving while others decode)."""

import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from stages.models.delay.config import DelayConfig
from stages.models.delay.processor import DelayProcessor
from stages.models.delay.runner import DelayRunner
from stages.models.realtime.processor import RealtimeProcessor
from stages.models.realtime.runner import RealtimeRunner
from stages.runtime.attention.backends import PaddedBatchAttention
from stages.runtime.checkpoint import read_config
from stages.runtime.tokenizer import TextTokenizer
from stages.tools.make_checkpoint import make_checkpoint
from tests.stages.runner_drive import drive

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TEXTS = ("A short one.", "Another sentence, a little longer than the first.", "Third.")


def params(seed: int, frames: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=1.1, text_temperature=1.0,
                          seed=seed, forced_frames=frames)


@pytest.mark.parametrize("variant", ["delay", "realtime"])
def test_captured_backbone_graphs_equal_the_one_call_step(tmp_path, variant):
    make_checkpoint(tmp_path, variant=variant, size="tiny", seed=5)
    if variant == "delay":
        processor = DelayProcessor(TextTokenizer.from_dir(tmp_path), DelayConfig.from_dict(read_config(tmp_path)))
        make = DelayRunner.from_dir
    else:
        processor = RealtimeProcessor.from_dir(tmp_path)
        make = RealtimeRunner.from_dir
    prompts = [processor.build_prompt(t) for t in TEXTS]
    arrivals = {0: [(1, prompts[0], params(1, 8))], 3: [(2, prompts[1], params(2, 6))], 7: [(3, prompts[2], params(3, 5))]}

    def run(graph_path, prefill_graphs=False):
        runner = make(tmp_path, device="cuda", max_running=4, num_kv_blocks=64, prefill_chunk_tokens=16,
                      attention=PaddedBatchAttention(), graph_path=graph_path, prefill_graphs=prefill_graphs)
        return drive(runner, arrivals), runner

    eager, _ = run("off")
    graphed, runner = run("cuda")
    assert runner.backbone_graph_path == "cuda" and runner._backbone_graphs.keys
    assert all(g.call.graph is not None for g in runner._backbone_graphs._graphs.values())
    prefilled, with_prefill = run("cuda", prefill_graphs=True)  # prompt chunks from captured graphs too
    assert with_prefill.prefill_graphs.keys
    assert all(g.call.graph is not None for g in with_prefill.prefill_graphs._graphs.values())
    for rid in eager:
        assert len(eager[rid]) > 0
        np.testing.assert_array_equal(graphed[rid], eager[rid])
        np.testing.assert_array_equal(prefilled[rid], eager[rid])
