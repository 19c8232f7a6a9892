"""On a GPU, in the batch-invariant mode: 8 seeded requests give identical tokens alone, together,
and mixed into 64 other requests (Local-v1.5 at full size and the 1.7B Delay shape, random bf16
weights, CUDA graphs, forced lengths). Without the mode they differ completely on an H200; the test
prints whether they do here, as the control."""

import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from tests.stages.runner_drive import drive

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FRAMES = 16


def local_v15_runner(invariant: bool, max_running: int):
    from stages.models.local_v15.config import full_size_config
    from stages.models.local_v15.loader import build_talker_module
    from stages.models.local_v15.runner import LocalV15Runner

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_talker_module(full_size_config()).to(torch.bfloat16).eval()
    return LocalV15Runner(model, cuda_graphs=True, max_running=max_running, num_kv_blocks=4096,
                          batch_invariant=invariant, prefill_graphs=True,
                          **({} if invariant else {"attention": _auto_attention()}))


def delay_runner(invariant: bool, max_running: int):
    from stages.models.delay.config import DelayConfig, full_size_config
    from stages.models.delay.model import DelayModel
    from stages.models.delay.runner import DelayRunner

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DelayModel(DelayConfig.from_dict(full_size_config("voice-generator"))).to(torch.bfloat16).eval()
    return DelayRunner(model, cuda_graphs=True, max_running=max_running, num_kv_blocks=4096,
                       batch_invariant=invariant, **({} if invariant else {"attention": _auto_attention()}))


def _auto_attention():
    from stages.runtime.attention.backends import make_attention

    return make_attention("auto", "cuda")


def requests(runner, first_rid: int, n: int, seed: int) -> list:
    """n requests: random text rows (lengths 40..200), audio columns padded, seeded sampling."""
    rng = np.random.default_rng(seed)
    pad = runner.model.config.audio_pad_code
    out = []
    for i in range(n):
        rows = np.full((int(rng.integers(40, 200)), 1 + runner.n_vq), pad, np.int64)
        rows[:, 0] = rng.integers(1000, 100000, len(rows))
        out.append((first_rid + i, rows, SamplingParams(seed=seed * 1000 + i, max_new_frames=FRAMES,
                                                         forced_frames=FRAMES)))
    return out


def compositions(make, invariant: bool) -> tuple[dict, dict, dict]:
    """The 8 requests' frames alone (one at a time), together, and mixed into 64 others."""
    runner = make(invariant, 72)
    eight = requests(runner, 100, 8, seed=1)
    others = requests(runner, 1000, 64, seed=2)
    alone = {}
    for req in eight:
        alone |= drive(runner, {0: [req]})
    together = drive(runner, {0: eight})
    mixed = drive(runner, {0: others[:32], 1: eight, 3: others[32:]})
    return alone, together, {rid: mixed[rid] for rid in alone}


@pytest.mark.parametrize("make", [local_v15_runner, delay_runner], ids=["local-v1.5", "delay"])
def test_eight_seeded_requests_same_tokens_alone_together_mixed(make):
    alone, together, mixed = compositions(make, invariant=True)
    for rid in alone:
        np.testing.assert_array_equal(alone[rid], together[rid], err_msg=f"{rid}: alone vs together")
        np.testing.assert_array_equal(alone[rid], mixed[rid], err_msg=f"{rid}: alone vs mixed")
    torch.cuda.empty_cache()
    off = compositions(make, invariant=False)  # the control: how many differ without the mode
    differ = sum(not np.array_equal(off[0][rid], off[i][rid]) for rid in off[0] for i in (1, 2))
    print(f"{make.__name__}: without the mode {differ} of 16 comparisons differ")
