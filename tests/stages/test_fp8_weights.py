"""`talker.fp8_weights`: matmuls from float8 weights with per-row activation scales, the named
layers only, and a served talker whose outputs stay near the full-precision ones."""

import pytest
import torch
from torch import nn

from bench.kernels.fp8_fidelity import compare, outputs
from profiles import load_profile
from stages.models.local_v15.config import tiny_config
from stages.models.local_v15.loader import build_talker_module
from stages.models.local_v15.runner import load_talker_runner
from stages.runtime.fp8_linear import FP8, Fp8Linear, as_fp8, has_fp8_matmuls
from tests.stages.test_local_v15_runner import mixed_requests, run


def assert_same_ends(runner, plain, reqs) -> None:
    """`runner` serves `reqs` to the ends `plain` reaches: every request finished, forced lengths
    exact (the codes may differ where float8's rounding moves a sampled token)."""
    frames, finish = run(runner, reqs)
    want_frames, want_finish = run(plain, reqs)
    assert set(finish) == set(want_finish) == set(reqs)
    for rid, (_, params) in reqs.items():
        if params.forced_frames is not None:
            assert len(frames[rid]) == len(want_frames[rid]) == params.forced_frames, rid


@torch.no_grad()
@pytest.mark.parametrize("bias", [False, True])
def test_a_float8_linear_multiplies_its_quantized_operands(bias):
    """w8a8: the product of the dequantized operands (each row of x and of W to within 1/16 of
    itself), a few percent from the full-precision product, and an all-zero row gives zeros, not
    NaN."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    fp8 = as_fp8(linear, "w8a8")
    assert fp8.weight_fp8.dtype == FP8 and fp8.weight_scale.shape == (1, 48)
    x = torch.randn(3, 5, 64)
    x[1, 2] = 0.0
    y = fp8(x)
    assert y.shape == (3, 5, 48) and y.dtype == x.dtype
    x2 = x.reshape(-1, 64)
    sx = x2.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    xq = (x2 / sx).to(FP8).float() * sx  # [15, 64]
    wq = fp8.weight_fp8.float() * fp8.weight_scale.t()  # [48, 64]
    want = xq @ wq.t() + (linear.bias if bias else 0.0)
    torch.testing.assert_close(y.reshape(-1, 48), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(y[1, 2], linear.bias if bias else torch.zeros(48))
    exact = linear(x)
    assert ((y - exact).norm() / exact.norm()).item() < 0.06
    assert as_fp8(fp8) is fp8


@torch.no_grad()
@pytest.mark.parametrize("bias", [False, True])
def test_a_w8a16_linear_multiplies_its_input_by_the_dequantized_weights(bias):
    """w8a16 (the default): x as it is times the dequantized weights, closer to the exact product
    than with x quantized too; an all-zero row gives zeros."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    fp8 = as_fp8(linear)
    assert fp8.scheme == "w8a16"
    x = torch.randn(3, 5, 64)
    x[1, 2] = 0.0
    y = fp8(x)
    assert y.shape == (3, 5, 48) and y.dtype == x.dtype
    want = x @ (fp8.weight_fp8.float() * fp8.weight_scale.t()).t() + (linear.bias if bias else 0.0)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[1, 2], linear.bias if bias else torch.zeros(48))
    exact = linear(x)
    both = as_fp8(linear, "w8a8")(x)
    assert ((y - exact).norm() / exact.norm()).item() < ((both - exact).norm() / exact.norm()).item() < 0.06
    with pytest.raises(ValueError, match="scheme"):
        as_fp8(linear, "w4a16")


def test_shapes_a_float8_matmul_cannot_take_are_refused():
    with pytest.raises(ValueError, match="divisible by 16"):
        as_fp8(nn.Linear(64, 40))
    with pytest.raises(TypeError, match="nn.Linear"):
        as_fp8(nn.Conv1d(16, 16, 1))


@torch.no_grad()
def test_the_talker_swaps_the_named_matmuls_only():
    """backbone: the seven projections of each Qwen3 layer (four when fused); all: the local
    block's four too; embeddings, norms and heads stay as they were."""
    model = build_talker_module(tiny_config()).eval()
    layers = model.config.backbone.num_layers
    assert model.use_fp8_weights("none") == 0
    assert model.use_fp8_weights("backbone") == 7 * layers
    assert model.use_fp8_weights("backbone") == 0  # again: nothing left to swap
    assert model.use_fp8_weights("all") == 4 * len(model.local_transformer.h)
    swapped = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert "transformer.layers.0.self_attn.q_proj" in swapped and "local_transformer.h.0.mlp.fc_in" in swapped
    assert isinstance(model.local_text_lm_head, nn.Linear) and not isinstance(model.local_text_lm_head, Fp8Linear)
    assert all(p.dtype != FP8 for p in model.parameters())  # float8 tensors are buffers
    with pytest.raises(ValueError, match="none, backbone or all"):
        model.use_fp8_weights("heads")


def test_float8_matmuls_need_the_cpu_or_cuda_from_sm89(monkeypatch):
    """An A100 (8.0) has none, an L4 (8.9) and an H100/H200 (9.0) have them; the CPU has torch's."""
    assert has_fp8_matmuls("cpu")
    for capability, has in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert has_fp8_matmuls("cuda:0") is has, capability


def test_without_float8_matmuls_the_runner_keeps_its_weights_and_says_so(local_v15_dir, monkeypatch, caplog):
    """A profile asking for float8 weights on a device without float8 matmuls (the opt-in float8
    backbone on an A100) serves the loaded weights instead of failing at the first step, with a warning."""
    from stages.models.local_v15 import runner as runner_module

    seen = []
    monkeypatch.setattr(runner_module, "has_fp8_matmuls", lambda device: seen.append(device) and False)
    profile = load_profile("cpu", ["talker.fp8_weights=backbone", "talker.fp8_scheme=w8a8"])
    with caplog.at_level("WARNING", logger=runner_module.__name__):
        runner = load_talker_runner(local_v15_dir, profile, "cpu")
    assert seen == ["cpu"]
    assert not any(isinstance(m, Fp8Linear) for m in runner.model.modules())
    assert "talker.fp8_weights backbone" in caplog.text and "no float8 matmuls" in caplog.text


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8"])
def test_a_runner_with_fp8_weights_serves_outputs_near_full_precision(local_v15_dir, scheme):
    """Built from the profile (after the fused projections), the runner serves the mixed requests
    to their ends, and its model's teacher-forced logits stay near the loaded model's: float8
    moves the sampled distribution by a small KL and keeps most tokens' most likely code."""
    reqs = mixed_requests(local_v15_dir)
    plain = load_talker_runner(local_v15_dir, load_profile("cpu"), "cpu")
    runner = load_talker_runner(local_v15_dir, load_profile(
        "cpu", ["talker.fp8_weights=all", "talker.fused_projections=true", f"talker.fp8_scheme={scheme}"]), "cpu")
    layer = runner.model.transformer.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.mlp.gate_up_proj, Fp8Linear)
    assert layer.mlp.gate_up_proj.scheme == scheme
    assert_same_ends(runner, plain, reqs)
    cfg = runner.model.config
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, cfg.codebook_size, (2, 24, 1 + cfg.n_vq), generator=g)
    rows[..., 0] = torch.randint(0, cfg.backbone.vocab_size, (2, 24), generator=g)
    codes = torch.randint(0, cfg.codebook_size, (48, cfg.n_vq), generator=g)
    got = compare(*outputs(runner.model, rows, codes), *outputs(plain.model, rows, codes), 1.7, 25)
    assert 0 < got["hidden_rel"] < 0.1 and 0 < got["logits_rel"] < 0.1, got
    assert got["kl"] < 1e-2 and got["top1"] > 0.9, got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_on_cuda_a_float8_linear_multiplies_its_quantized_operands():
    """CUDA's float8 kernel with the row and channel scales after it (w8a8) computes the
    dequantized operands' product (to bf16's rounding of the output), bf16 and fp32 inputs
    alike, at a decode step's few rows and at a prefill's many."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        linear = nn.Linear(2560, 1024, bias=True, device="cuda").to(dtype)
        fp8 = as_fp8(linear, "w8a8")
        for rows in (1, 44, 88, 1000):
            x = torch.randn(rows, 2560, device="cuda").to(dtype)
            sx = x.float().abs().amax(-1, keepdim=True) / 448.0
            xq = (x.float() / sx).to(FP8).float() * sx
            want = xq @ (fp8.weight_fp8.float() * fp8.weight_scale.t()).t() + linear.bias.float()
            got = fp8(x)
            assert got.dtype == dtype
            assert ((got.float() - want).norm() / want.norm()).item() < 1e-2, rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", ["w8a16", "w8a8", "w8a8-swiglu", "w8a8-swiglu-scales", "w8a8-swiglu-scales-norms"])
def test_inductor_compiled_talker_with_fp8_weights_matches_eager_on_cuda(scheme):
    """Float8 matmuls (and their per-row quantization, which inductor fuses into the kernels
    before them, or with w8a8-swiglu the MLPs' SiLU product quantized by its own kernel, called
    from the compiled code, and with -scales the products' scales left to the kernels after
    them, the layers storing by the kernel with their sums deferred, and with -norms the sums,
    norms and quantization in one kernel each) inside the compiled
    backbone halves and local loop: greedy requests through a runner emit the eager float8
    talker's codes."""
    from tests.stages.test_talker_compile import _codes, _cuda_pair, assert_same_codes

    from stages.models.qwen3 import fuse_projections

    eager, compiled = _cuda_pair()
    scheme, *kernels = scheme.split("-")
    if kernels:  # the kernels read fused products; the eager talker keeps the torch ops
        fuse_projections(eager.transformer)
        fuse_projections(compiled.transformer)
    assert eager.use_fp8_weights("all", scheme) == compiled.use_fp8_weights("all", scheme) > 0
    layers = compiled.config.backbone.num_layers
    if "swiglu" in kernels:
        assert compiled.transformer.use_fp8_swiglu() == layers
    if "scales" in kernels:
        for model in (eager, compiled):
            model.transformer.store_kv_by_kernel()
            model.transformer.defer_residuals()
        assert compiled.transformer.use_fp8_scales_later() == 2 * layers
    if "norms" in kernels:  # with them, each residual sum, norm and quantization by one kernel
        assert compiled.transformer.use_fp8_norms() == layers
    assert_same_codes(_codes(eager, greedy=True), _codes(compiled, greedy=True))
