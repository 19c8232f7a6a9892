"""The fidelity check of precision changes (`stages.models.local_v15.precision_check`): bf16 against
itself passes, a broken float8 quantization fails, float8 on plain random weights passes, and
the outlier channels of released LLMs make float8 cost several times more."""

import pytest
import torch

from profiles import load_profile
from stages.models.local_v15.precision_check import check_precision, precision_changes
from stages.runtime import fp8_linear
from stages.runtime.fidelity import FidelityBound
from stages.tools.make_checkpoint import make_checkpoint
from stages.tools.outlier_channels import OutlierChannels

pytestmark = pytest.mark.usefixtures("one_torch_thread")
W8A8 = ["talker.fp8_weights=backbone", "talker.fp8_scheme=w8a8"]
SHIPPED_FP8 = W8A8 + ["talker.fused_projections=true", "talker.fp8_fused_swiglu=true",
                      "talker.fused_qk_rope_store=true", "talker.deferred_residuals=true",
                      "talker.fp8_fused_scales=true"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(plain, with outlier channels): tiny random Local-v1.5 checkpoints of one seed."""
    root = tmp_path_factory.mktemp("precision")
    make_checkpoint(root / "plain", size="tiny")
    make_checkpoint(root / "outliers", size="tiny", outliers=OutlierChannels())
    return root / "plain", root / "outliers"


def run(model_dir, sets, **kw):
    return check_precision(model_dir, load_profile("cpu", sets), "cpu", prompts=4, frames=32, **kw)


def test_bf16_against_itself_passes(checkpoints):
    report = run(checkpoints[1], [])
    assert report.changes == ()
    assert report.candidate.kl == 0 and report.candidate.top1 == report.candidate.sampled == 1.0
    assert report.bf16.kl > 0  # fp32 and bf16 do differ: the check sees rounding
    assert report.passed and report.lines()[-1] == "PASS"


def test_a_broken_float8_quantization_fails(checkpoints, monkeypatch):
    """Row scales 2^16 times too large leave each row's largest value three steps of float8's
    smallest subnormal and most values zero: the check fails it by far, where the real
    quantization of the same weights passes. (Random weights' flat distributions hide smaller
    errors: the backbone's matmuls all zero cost these tiny weights only ~0.02 nats a code.)"""
    good = run(checkpoints[0], W8A8)

    def broken(x):
        amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=fp8_linear.AMAX_FLOOR)
        scale = 2**16 * amax / fp8_linear.FP8_MAX
        return (x.float() / scale).to(fp8_linear.FP8), scale

    monkeypatch.setattr(fp8_linear, "quantize_rows", broken)
    bad = run(checkpoints[0], W8A8)
    assert good.passed, good.lines()
    assert not bad.passed and bad.candidate.kl > 10 * good.candidate.kl, (good.lines(), bad.lines())
    assert bad.failures == [f"KL {bad.candidate.kl:.3g} nats a code > 0.001"]
    assert bad.lines()[-2:] == [f"  exceeded: {bad.failures[0]}", "FAIL"]


def test_outlier_channels_make_float8_cost_more(checkpoints):
    """The shipped float8 layer (w8a8 with its fused SwiGLU and scales, here through the torch ops)
    on the same random weights with and without outlier channels: the outliers cost several
    times the KL and flip more codes; bf16 itself stays far below either."""
    plain, outliers = (run(d, SHIPPED_FP8) for d in checkpoints)
    assert outliers.candidate.kl > 3 * plain.candidate.kl, (plain.lines(), outliers.lines())
    assert outliers.candidate.top1 < plain.candidate.top1 and outliers.candidate.sampled < plain.candidate.sampled
    assert all(r.bf16.kl < r.candidate.kl / 5 for r in (plain, outliers))


def test_the_bound_is_the_mean_kl_against_bf16(checkpoints):
    """Any KL above `max_kl` fails, whatever the agreements; the report names the changes."""
    report = run(checkpoints[0], SHIPPED_FP8 + ["talker.kv_cache_dtype=fp8"], bound=FidelityBound(max_kl=0.0))
    assert report.changes == ("talker.fp8_weights=backbone", "talker.fp8_scheme=w8a8",
                              "talker.fp8_fused_swiglu=true", "talker.fp8_fused_scales=true",
                              "talker.kv_cache_dtype=fp8")
    assert not report.passed and "precision changes: talker.fp8_weights=backbone" in report.lines()[0]


def test_the_changes_are_the_precision_settings_only():
    assert precision_changes(load_profile("cpu", ["talker.fused_projections=true"])) == ()
    assert precision_changes(load_profile("cpu", ["talker.kv_cache_dtype=fp8"])) == ("talker.kv_cache_dtype=fp8",)


def test_a_device_without_float8_matmuls_is_refused(checkpoints, monkeypatch):
    """Before sm89 the served weights would stay bf16: a check there would compare bf16 with
    itself, so it refuses."""
    from stages.models.local_v15 import precision_check

    monkeypatch.setattr(precision_check, "has_fp8_matmuls", lambda device: False)
    with pytest.raises(ValueError, match="no float8 matmuls"):
        run(checkpoints[0], W8A8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_check_runs_the_real_kernels(checkpoints):
    """high-concurrency's float8 layer on CUDA (cuBLAS's float8 matmuls, the SwiGLU and scales
    kernels, the q/k norm, RoPE and store kernel, the Triton paged attention and local attention;
    eager, so three ways of two checkpoints compile nothing): the report's figures come out, and
    the outlier channels cost float8 more there too."""
    if not fp8_linear.has_fp8_matmuls("cuda"):
        pytest.skip("needs float8 matmuls (sm89 and later)")
    sets = SHIPPED_FP8 + ["talker.compile=false"]
    plain, outliers = (check_precision(d, load_profile("high-concurrency", sets), "cuda", prompts=4, frames=32)
                       for d in checkpoints)
    for report in (plain, outliers):
        assert report.device == "cuda" and 0 < report.bf16.kl < report.candidate.kl, report.lines()
    assert outliers.candidate.kl > 2 * plain.candidate.kl, (plain.lines(), outliers.lines())
