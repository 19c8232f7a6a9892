"""`LocalV15Talker.compile_hot_paths`: the compiled serving path traces without breaking and emits
the eager path's codes (dynamo with the `eager` backend on CPU; inductor itself runs on the GPU)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from stages.models.local_v15.config import tiny_config
from stages.models.local_v15.loader import build_talker_module
from stages.models.local_v15.runner import LocalV15Runner


def _codes(model, *, fused_sampling: bool = False, greedy: bool = False) -> dict[int, list[np.ndarray]]:
    runner = LocalV15Runner(model, max_running=3, num_kv_blocks=32, prefill_chunk_tokens=8,
                            max_prefill_tokens_per_step=16, fused_sampling=fused_sampling)
    for rid in range(3):
        prompt = np.full((6 + 5 * rid, 13), 1024, np.int64)
        prompt[:, 0] = (np.arange(len(prompt)) * 7 + rid) % 600
        runner.add(rid, prompt, SamplingParams(seed=rid, greedy=greedy or rid == 0, forced_frames=3))
    codes: dict[int, list[np.ndarray]] = {rid: [] for rid in range(3)}
    while runner.num_running():
        for ev in runner.step():
            if ev.codes is not None:
                codes[ev.rid].append(ev.codes)
    return codes


def _cpu_pair():
    """(eager, compiled by dynamo's eager backend) tiny talkers with the same weights on CPU."""
    torch.manual_seed(0)
    eager = build_talker_module(tiny_config()).eval()
    compiled = build_talker_module(tiny_config()).eval()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_hot_paths(backend="eager")
    return eager, compiled


@pytest.mark.slow
def test_compiled_talker_emits_the_eager_codes():
    eager, compiled = _cpu_pair()
    assert_same_codes(_codes(eager), _codes(compiled))


def assert_same_codes(want: dict[int, list[np.ndarray]], got: dict[int, list[np.ndarray]]) -> None:
    """Every request's three forced frames, code for code."""
    assert all(len(want[r]) == 3 for r in want) and set(got) == set(want)
    for rid in want:
        np.testing.assert_array_equal(np.array(got[rid]), np.array(want[rid]))


def _cuda_pair():
    """(eager, compiled by inductor) tiny talkers with the same weights on CUDA, fp32, TF32 off."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    eager = build_talker_module(tiny_config()).eval().cuda()
    compiled = build_talker_module(tiny_config()).eval().cuda()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_hot_paths()
    return eager, compiled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("local_attention", ["sdpa", "plain", "kernel"])
def test_inductor_compiled_talker_matches_eager_on_cuda(local_attention):
    """The real compiler (inductor, Triton kernels) on CUDA: fp32 with TF32 off, greedy requests
    emit the eager codes (the tiny model's logits are far apart next to fp32 reassociation); with
    the local steps attending plainly (`talker.local_attention: plain`) or by the kernel
    (`kernel`, traced into the compiled loop) too, against the eager talker's SDPA."""
    from stages.models.local_v15.model import GreedyFrameSampler

    eager, compiled = _cuda_pair()
    compiled.local_transformer.attend_plainly(local_attention == "plain")
    compiled.local_transformer.attend_by_kernel(local_attention == "kernel")
    h = torch.randn(6, eager.config.hidden_size, device="cuda")
    with torch.inference_mode():
        stop_e, codes_e = eager.decode_frame(h, GreedyFrameSampler())
        stop_c, codes_c = compiled.decode_frame(h, GreedyFrameSampler())
    assert torch.equal(stop_e, stop_c) and torch.equal(codes_e, codes_c)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inductor_compiled_talker_with_the_local_attention_kernel_through_a_runner_on_cuda():
    """The local attention kernel in the compiled loop as a runner steps it (prefill, decode,
    forced stops): greedy requests emit the eager talker's codes, fp32, TF32 off."""
    eager, compiled = _cuda_pair()
    compiled.local_transformer.attend_by_kernel()
    assert_same_codes(_codes(eager, greedy=True), _codes(compiled, greedy=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inductor_compiled_talker_with_fused_sampling_matches_eager_on_cuda():
    """The sampling kernel inside the compiled local loop (a Triton kernel of ours that dynamo
    traces into the compiled graph): greedy requests emit the eager runner's codes, fp32, TF32 off."""
    eager, compiled = _cuda_pair()
    assert_same_codes(_codes(eager, fused_sampling=True, greedy=True),
                      _codes(compiled, fused_sampling=True, greedy=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fused", [("projections",), ("kv_writes",), ("projections", "kv_writes")])
def test_inductor_compiled_talker_with_fused_backbone_parts_matches_eager_on_cuda(fused):
    """The backbone's q/k/v and gate/up as one matmul each (`talker.fused_projections`) and its KV
    stores inside the compiled layer half (`talker.fused_kv_writes`), compiled: greedy requests
    through a runner emit the eager unfused talker's codes, fp32, TF32 off."""
    from stages.models.qwen3 import fuse_projections

    eager, compiled = _cuda_pair()
    if "projections" in fused:
        fuse_projections(compiled.transformer)
    compiled.transformer.store_kv_in_layers("kv_writes" in fused)
    assert_same_codes(_codes(eager, greedy=True), _codes(compiled, greedy=True))


@pytest.mark.slow
def test_the_first_warm_up_batches_compile_the_local_loop_once_a_shape():
    """A runner's steps and graph bodies run in inference mode, so every tensor the compiled parts
    meet is of one kind: dynamo guards on a tensor's dispatch keys, and a frame graph's static
    input made outside inference mode next to a decode body's hidden states made inside compiled
    the local loop once more for each kind. The warm-up's batch of one and batch of two compile
    it twice in all: for one row (torch specialises a size of 1) and shape-generic."""
    new = _first_warm_up_batches_compiles()
    assert not [m.recompile_reason for m in new if "dispatch key" in (m.recompile_reason or "")]
    assert [m.co_name for m in new].count("decode_frame") == 2


@pytest.mark.slow
def test_size_oblivious_shapes_compile_the_local_loop_once():
    """`talker.compile_size_oblivious` (the talker worker's `compile_size_oblivious`): a batch of
    one is not specialised, so one shape-generic compile of the local loop serves both batches,
    and each backbone half compiles at most twice, and the same codes come out as eagerly."""
    from torch.fx.experimental import _config as fx_config

    from stages.workers.common import compile_size_oblivious

    before = fx_config.backed_size_oblivious
    try:
        assert compile_size_oblivious()
        new = _first_warm_up_batches_compiles()
        eager, compiled = _cpu_pair()
        assert_same_codes(_codes(eager), _codes(compiled))
    finally:
        fx_config.backed_size_oblivious = before
    names = [m.co_name for m in new]
    assert names.count("decode_frame") == 1 and names.count("embed_rows") == 1
    assert max(names.count(name) for name in names) <= 2


def _first_warm_up_batches_compiles() -> list:
    """Dynamo's records of the compiles of a new tiny compiled talker (the eager backend) through
    the warm-up's first two batches (one request alone, then two) on the eager graph path."""
    from torch._dynamo.utils import get_compilation_metrics

    from stages.workers.talker import run_together

    torch._dynamo.reset()  # what earlier tests compiled (the same functions) is compiled anew
    torch.manual_seed(0)
    model = build_talker_module(tiny_config()).eval()
    model.compile_hot_paths(backend="eager")
    runner = LocalV15Runner(model, max_running=4, num_kv_blocks=64, prefill_chunk_tokens=32,
                            max_prefill_tokens_per_step=64, graph_path="eager")
    prompt = np.full((20, 13), 1024, np.int64)
    prompt[:, 0] = np.arange(20) % 600
    request = SimpleNamespace(prompt=prompt, sampling=SamplingParams(seed=1, forced_frames=3))
    before = get_compilation_metrics()
    run_together(runner, [(-1, request)], max_steps=8)
    run_together(runner, [(-2, request), (-3, request)], max_steps=8)
    return [m for m in get_compilation_metrics() if not any(m is b for b in before)]
