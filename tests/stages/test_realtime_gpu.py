"""Realtime talker on CUDA: golden greedy frames in fp32 (with and without repetition penalty)."""

import json

import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from stages.models.realtime.processor import RealtimeProcessor
from stages.models.realtime.runner import RealtimeRunner
from tests.conftest import golden_dir

GOLDEN = golden_dir("moss_tts_realtime")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("graph_path", ["off", "cuda"])
@pytest.mark.parametrize("name", ["plain", "voice_clone"])
@pytest.mark.parametrize("penalty,key", [(1.0, "generated_frames"), (1.1, "generated_frames_rep_penalty_1_1")])
def test_golden_on_cuda_fp32(name, penalty, key, graph_path):
    with np.load(GOLDEN / f"case_{name}.npz") as z:
        g = {k: z[k] for k in z.files}
    text = json.loads((GOLDEN / "cases.json").read_text())["text"]
    prompt = RealtimeProcessor.from_dir(GOLDEN).build_prompt(text, reference=g.get("reference_audio_codes"))
    runner = RealtimeRunner.from_dir(GOLDEN, device="cuda", max_running=2, num_kv_blocks=64, graph_path=graph_path,
                                     upstream_sampling=True)
    runner.add(1, prompt, SamplingParams(greedy=True, temperature=0.0, repetition_penalty=penalty, max_new_frames=13))
    frames = []
    while runner.num_running():
        frames += [e.codes for e in runner.step() if e.codes is not None]
    np.testing.assert_array_equal(np.stack(frames), g[key])
