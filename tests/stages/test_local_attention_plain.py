"""`talker.local_attention: plain`: a frame's local steps attend by products and sums instead of
SDPA, with SDPA's results (up to float32 rounding) and, through a served runner, the same frames."""

import numpy as np
import torch

from profiles import load_profile
from stages.models.local_v15.config import LocalBlockConfig, tiny_config
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
            rope, cache = local.rope_tables(12, x), local.new_cache()
            outs[plain] = torch.stack([local.step(x[p], p, rope, cache) for p in range(12)])  # [12, B, H]
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[True][1:], outs[True][1:].roll(1, dims=1))  # rows differ: a real check


def test_a_runner_with_plain_local_attention_makes_the_same_frames(local_v15_dir):
    """Eight requests of mixed settings (sampled, penalised, stops by the model and forced
    lengths) through runners built from the profile both ways."""
    assert_same_frames_each_way(local_v15_dir, mixed_requests(local_v15_dir), "sdpa", "plain", min_frames=20)


def assert_same_frames_each_way(local_v15_dir, reqs, base: str, other: str, min_frames: int) -> None:
    """`reqs` through runners built from the cpu profile with `talker.local_attention` `base` and
    `other`: each runner's local block attends as asked, and both give every request the same
    frames and finish (at least `min_frames` frames in all)."""
    frames, finish = {}, {}
    for how in (base, other):
        runner = load_talker_runner(local_v15_dir, load_profile("cpu", [f"talker.local_attention={how}"]), "cpu")
        blocks = runner.model.local_transformer.h
        assert all((b.attn.plain_step, b.attn.kernel_step) == (how == "plain", how == "kernel") for b in blocks)
        frames[how], finish[how] = run(runner, reqs)
    assert finish[other] == finish[base] and len(finish[base]) == len(reqs)
    assert sum(len(f) for f in frames[base].values()) >= min_frames
    for rid in reqs:
        np.testing.assert_array_equal(frames[other][rid], frames[base][rid], err_msg=str(rid))


def test_a_compiled_frame_writes_no_cache_buffer():
    """The local loop as torch.compile sees it after functionalization: a frame's keys and values
    are kept position by position, so no write into a [B, P, heads, D] buffer becomes a scatter
    that copies the whole buffer (12 positions, two buffers a block: the frame graph's largest
    pointwise kernels on an H200 before)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from stages.models.local_v15.loader import build_talker_module
    from stages.models.local_v15.model import GreedyFrameSampler

    torch.manual_seed(0)
    model = build_talker_module(tiny_config()).eval()
    seen = []

    def keep(gm, _inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    for plain in (True, False):
        seen.clear()
        model.local_transformer.attend_plainly(plain)
        frame = torch.compile(lambda h: model.decode_frame(h, GreedyFrameSampler()), backend=aot_autograd(fw_compiler=keep))
        with torch.no_grad():
            stop, codes = frame(torch.randn(3, model.config.hidden_size))
        assert codes.shape == (3, model.config.n_vq)
        assert any("mm" in t for t in seen)  # the graph was seen
        writes = [t for t in seen if "scatter" in t or "index_put" in t or t.startswith("aten.copy")]
        assert not writes, (plain, writes)  # (aten._to_copy, a cast, is not a write)
