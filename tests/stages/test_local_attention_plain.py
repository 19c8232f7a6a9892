"""`talker.local_attention: plain`: a frame's local steps attend by products and sums instead of
SDPA, with SDPA's results (up to float32 rounding) and, through a served runner, the same frames."""

import numpy as np
import torch

from profiles import load_profile
from stages.models.local_v15.config import LocalBlockConfig
from stages.models.local_v15.model import LocalTransformer
from stages.models.local_v15.runner import load_talker_runner
from tests.stages.test_local_v15_runner import mixed_requests, run


def test_plain_local_steps_attend_as_sdpa_does():
    """Every position of a frame (1 to 12 keys), step by step through a filled cache."""
    torch.manual_seed(0)
    local = LocalTransformer(LocalBlockConfig(hidden_size=64, num_layers=2, num_heads=4, inner_size=128)).eval()
    x = torch.randn(12, 5, 64)  # [positions, B, H]
    outs = {}
    with torch.no_grad():
        for plain in (False, True):
            local.attend_plainly(plain)
            rope, cache = local.rope_tables(12, x), local.new_cache(5, 12, x)
            outs[plain] = torch.stack([local.step(x[p], p, rope, cache) for p in range(12)])  # [12, B, H]
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[True][1:], outs[True][1:].roll(1, dims=1))  # rows differ: a real check


def test_a_runner_with_plain_local_attention_makes_the_same_frames(local_v15_dir):
    """Eight requests of mixed settings (sampled, penalised, stops by the model and forced
    lengths) through runners built from the profile both ways."""
    reqs = mixed_requests(local_v15_dir)
    frames, finish = {}, {}
    for how in ("sdpa", "plain"):
        runner = load_talker_runner(local_v15_dir, load_profile("cpu", [f"talker.local_attention={how}"]), "cpu")
        assert all(b.attn.plain_step == (how == "plain") for b in runner.model.local_transformer.h)
        frames[how], finish[how] = run(runner, reqs)
    assert finish["plain"] == finish["sdpa"] and len(finish["sdpa"]) == len(reqs)
    assert sum(len(f) for f in frames["sdpa"].values()) >= 20
    for rid in reqs:
        np.testing.assert_array_equal(frames["plain"][rid], frames["sdpa"][rid], err_msg=str(rid))

