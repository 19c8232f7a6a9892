"""Delay talker on CUDA: golden greedy runs and teacher forcing in fp32, a bf16 smoke run."""


import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from stages.models.delay.runner import DelayRunner
from tests.conftest import golden_dir

GOLDEN = golden_dir("moss_tts_delay")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingParams(greedy=True, temperature=0.0, text_temperature=0.0, max_new_frames=1000)


@pytest.mark.parametrize("graph_path", ["off", "cuda"])
@pytest.mark.parametrize("name", ["plain", "voice_clone", "continuation"])
def test_golden_on_cuda_fp32(name, graph_path):
    with np.load(GOLDEN / f"case_{name}.npz") as z:
        g = {k: z[k] for k in z.files}
    runner = DelayRunner.from_dir(GOLDEN, device="cuda", max_running=2, num_kv_blocks=64, finish_on_audio_end=False,
                                  graph_path=graph_path)  # "cuda": decode rows replayed from captured graphs
    runner.add(1, g["input_ids"], GREEDY)
    for _ in range(48):
        runner.step()
    np.testing.assert_array_equal(runner.rows(1)[-48:], g["generated_rows"])
    with torch.no_grad():
        hidden = runner.model.forward_dense(torch.from_numpy(g["tf_input_ids"]).cuda()[None])[0]
        audio = runner.model.audio_logits(hidden)[..., :-1].cpu().numpy()
    np.testing.assert_allclose(hidden.cpu().numpy(), g["tf_last_hidden"], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(audio, g["tf_audio_logits"][..., :-1], atol=1e-4, rtol=1e-4)


def test_bf16_batch_streams_forced_lengths():
    with np.load(GOLDEN / "case_plain.npz") as z:
        prompt = z["input_ids"]
    runner = DelayRunner.from_dir(GOLDEN, device="cuda", dtype=torch.bfloat16, max_running=4, num_kv_blocks=64)
    for rid, frames in ((1, 3), (2, 5), (3, 4)):
        runner.add(rid, prompt, SamplingParams(seed=rid, forced_frames=frames))
    got = {1: 0, 2: 0, 3: 0}
    for _ in range(60):
        for e in runner.step():
            got[e.rid] += e.codes is not None
        if runner.num_running() == 0:
            break
    assert got == {1: 3, 2: 5, 3: 4}
