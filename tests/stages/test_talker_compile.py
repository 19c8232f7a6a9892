"""`LocalV15Talker.compile_hot_paths`: the compiled serving path traces without breaking and emits
the eager path's codes (dynamo with the `eager` backend on CPU; inductor itself runs on the GPU)."""

import numpy as np
import pytest
import torch

from stages.local_v15.config import tiny_config
from stages.local_v15.loader import build_talker_module
from stages.local_v15.runner import LocalV15Runner
from stages.sampling import SamplingParams


def _codes(model) -> dict[int, list[np.ndarray]]:
    runner = LocalV15Runner(model, max_running=3, num_kv_blocks=32, prefill_chunk_tokens=8,
                            max_prefill_tokens_per_step=16)
    for rid in range(3):
        prompt = np.full((6 + 5 * rid, 13), 1024, np.int64)
        prompt[:, 0] = (np.arange(len(prompt)) * 7 + rid) % 600
        runner.add(rid, prompt, SamplingParams(seed=rid, greedy=rid == 0, forced_frames=3))
    codes: dict[int, list[np.ndarray]] = {rid: [] for rid in range(3)}
    while runner.num_running():
        for ev in runner.step():
            if ev.codes is not None:
                codes[ev.rid].append(ev.codes)
    return codes


@pytest.mark.slow
def test_compiled_talker_emits_the_eager_codes():
    torch.manual_seed(0)
    eager = build_talker_module(tiny_config()).eval()
    compiled = build_talker_module(tiny_config()).eval()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_hot_paths(backend="eager")
    want, got = _codes(eager), _codes(compiled)
    assert all(len(want[r]) == 3 for r in want)
    for rid in want:
        np.testing.assert_array_equal(np.array(got[rid]), np.array(want[rid]))
