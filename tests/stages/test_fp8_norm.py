"""`talker.fp8_fused_norms`: a float8 layer's residual sum, RMSNorm and row quantization in one
Triton kernel (`stages.runtime.fp8_norm`), on the CPU through Triton's interpreter: the kernel
against the torch ops, a model's serving path (eager and compiled) against the float8 model
without it, and a runner built from the profile."""

from tests import triton_cpu  # noqa: F401  (first: Triton's interpreter without a GPU)

import pytest  # noqa: E402
import torch  # noqa: E402

from profiles import load_profile  # noqa: E402
from profiles.schema import ProfileError  # noqa: E402
from stages.models.local_v15.runner import load_talker_runner  # noqa: E402
from stages.runtime.fp8_linear import FP8  # noqa: E402
from stages.runtime.fp8_norm import add_rms_norm_quant_kernel, add_rms_norm_quant_torch  # noqa: E402
from tests.stages.test_fp8_fused_scales import _float8_model, assert_served_alike  # noqa: E402
from tests.stages.test_fused_kv_writes import _serve  # noqa: E402
from tests.stages.test_fp8_weights import assert_same_ends  # noqa: E402
from tests.stages.test_local_v15_runner import mixed_requests  # noqa: E402
from tests.stages.test_qwen3 import CFG  # noqa: E402


def _inputs(n: int, h: int, dtype: torch.dtype, seed: int = 0):
    """A residual [n, h], a float8 product before its scales with its rows' and channels'
    scales, a norm weight away from 1; row 1 of the sum all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    raw = (torch.randn(n, h, generator=g) * 3000.0).to(dtype)
    row = torch.rand(n, 1, generator=g) * 1e-3 + 1e-4
    col = torch.rand(h, generator=g) * 1e-3 + 1e-4
    weight = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    if n > 1:
        x[1], raw[1] = 0.0, 0.0
    return x, raw, row, col, weight


def _same_codes(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same float8 codes, except that Triton's CPU interpreter rounds a value just under a
    power of two to half that power (its float8 cast drops the mantissa's carry; CUDA's does not)
    and a code off by one where fp32's last bit crosses a rounding edge."""
    got, want = got.float(), want.float()
    dropped_carry = (got == want / 2) & (torch.log2(want.abs()).frac() == 0)
    neighbour = torch.isclose(got, want, rtol=0.13, atol=0)
    assert (dropped_carry | neighbour).all() and (got == want).float().mean() > 0.97


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [64, 96])
def test_the_kernel_sums_norms_and_quantizes_as_the_torch_ops(dtype, h):
    """Rows of any width (96: a row masked past its end), fp32 and bf16: the sum as the torch ops
    round it, the rows' scales and float8 codes of the torch ops, an all-zero row as zeros with a
    finite scale. (Triton's CPU interpreter truncates fp32 to bf16 where CUDA rounds to nearest:
    bf16 here within a unit of the last place, exact in the GPU test.)"""
    args = _inputs(5, h, dtype)
    s, q, q_scale = add_rms_norm_quant_kernel(*args, 1e-6)
    want_s, want_q, want_scale = add_rms_norm_quant_torch(*args, 1e-6)
    assert s.dtype == dtype and q.dtype == FP8 and q.shape == (5, h) and q_scale.shape == (5, 1)
    exact = dtype == torch.float32
    torch.testing.assert_close(s, want_s, rtol=0 if exact else 2**-7, atol=0)
    torch.testing.assert_close(q_scale, want_scale, rtol=1e-5 if exact else 2e-2, atol=0)
    if exact:
        _same_codes(q, want_q)
    else:
        got, want = q.float() * q_scale, want_q.float() * want_scale
        assert ((got - want).norm() / want.norm()).item() < 0.1  # the halved values too
    assert torch.all(q[1].float() == 0) and torch.isfinite(q_scale).all()


def test_no_rows_no_launch():
    s, q, q_scale = add_rms_norm_quant_kernel(*_inputs(0, 64, torch.float32), 1e-6)
    assert s.shape == q.shape == (0, 64) and q_scale.shape == (0, 1)


def _normed_model(compiler: str | None = None, by_kernel: bool = True):
    """The float8 model of the fused scales' tests with the norms fused too; `by_kernel` False:
    every fused part through the torch ops (the same arithmetic, no interpreter float8 casts)."""
    model = _float8_model(True, compiler)
    assert model.use_fp8_norms() == CFG.num_layers
    for layer in model.layers:
        assert layer.fp8_norm_by_kernel
        layer.fp8_norm_by_kernel = layer.mlp.fp8_swiglu_by_kernel = by_kernel
    return model


def test_a_model_with_the_norms_by_the_torch_ops_serves_as_one_without():
    """Prefill chunks, decode tokens and a late joiner: the path through the fused norms' parts
    (their torch ops) gives every output and cache block of the float8 model whose norms the
    compiled halves keep (the same fp32 sums, norms and float8 values; both MLPs' SiLU products
    by the torch ops)."""
    plain = _float8_model(True)
    for layer in plain.layers:
        layer.mlp.fp8_swiglu_by_kernel = False
    want, want_cache = _serve(plain)
    got, cache = _serve(_normed_model(by_kernel=False))
    assert_served_alike(got, cache, want, want_cache, 1e-5)


@pytest.mark.parametrize("compiler", [None, "inductor"])
def test_a_model_with_the_norms_by_the_kernel_serves_near_the_torch_ops(compiler):
    """Through the kernels, eager and compiled (inductor, C++ on the CPU, the kernels its custom
    ops): the outputs of the same path by the torch ops to float8's rounding (the interpreter's
    halved values among them: the test above)."""
    want, _ = _serve(_normed_model(by_kernel=False))
    got, cache = _serve(_normed_model(compiler))
    for g, w in zip(got, want):
        assert ((g - w).norm() / w.norm()).item() < 0.1
    assert cache.keys[-1].abs().sum() > 0


def test_the_norms_need_the_whole_float8_layer_path():
    """Without the scales left to the kernels, or without the deferred sums, the model keeps its
    compiled norms."""
    model = _float8_model(False)
    assert model.use_fp8_norms() == 0 and not model.fp8_norms
    assert all(layer.fp8_norm is None for layer in model.layers)
    model = _float8_model(True)
    model.defer_residuals(False)
    assert model.use_fp8_norms() == 0
    model.defer_residuals()
    assert model.use_fp8_norms() == CFG.num_layers and model.use_fp8_norms(False) == 0


def test_the_profile_asks_for_the_swiglu_kernel_and_the_scales():
    base = ["talker.fp8_weights=backbone", "talker.fp8_scheme=w8a8", "talker.fused_projections=true",
            "talker.fused_qk_rope_store=true", "talker.deferred_residuals=true"]
    with pytest.raises(ProfileError, match="fp8_fused_norms needs"):
        load_profile("cpu", base + ["talker.fp8_fused_norms=true", "talker.fp8_fused_scales=true"])
    load_profile("cpu", base + ["talker.fp8_fused_norms=true", "talker.fp8_fused_scales=true",
                                "talker.fp8_fused_swiglu=true"])


@torch.no_grad()
def test_a_runner_with_the_fused_norms_serves_its_requests(local_v15_dir):
    """Built from the profile, every layer takes the fused norms and the runner serves four mixed
    requests to the ends the float8 runner without them reaches (forced lengths exact)."""
    reqs = dict(list(mixed_requests(local_v15_dir).items())[:4])
    args = ["talker.fp8_weights=backbone", "talker.fp8_scheme=w8a8", "talker.fused_projections=true",
            "talker.fused_qk_rope_store=true", "talker.deferred_residuals=true", "talker.fp8_fused_swiglu=true",
            "talker.fp8_fused_scales=true"]
    plain = load_talker_runner(local_v15_dir, load_profile("cpu", args), "cpu")
    runner = load_talker_runner(local_v15_dir, load_profile("cpu", args + ["talker.fp8_fused_norms=true"]), "cpu")
    assert runner.model.transformer.fp8_norms and not plain.model.transformer.fp8_norms
    assert_same_ends(runner, plain, reqs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_on_cuda_the_kernel_sums_norms_and_quantizes_as_the_torch_ops():
    """CUDA, the served width (2,560 columns a row) in bf16 at a decode step's few rows and a
    prefill's many: the sum, the rows' scales and float8 codes of the torch ops. The kernel adds
    `raw * scale` to x in one fused multiply-add (one rounding, the torch ops round twice) and
    its rsqrt is not torch's, so a value that lands on a bf16 rounding edge may come out one unit
    of the last place away: a few sums, a row's scale now and then, a few codes a neighbouring
    code (on an H200, one of 773,120 at 302 rows came out more than 13% from the torch ops':
    a neighbour below float8's normal range, where codes are 2**-9 apart, is the likely one)."""
    for n in (1, 48, 300):
        args = [t.cuda() for t in _inputs(n + 2, 2560, torch.bfloat16)]
        s, q, q_scale = add_rms_norm_quant_kernel(*args, 1e-6)
        want_s, want_q, want_scale = add_rms_norm_quant_torch(*args, 1e-6)
        _within_one_bf16_unit(s.float(), want_s.float(), exact_share=0.999, what=f"sum, {n} rows")
        _within_one_bf16_unit(q_scale, want_scale, exact_share=0.95, what=f"row scales, {n} rows")
        steps = _code_steps(q, want_q)
        same = (steps == 0).float().mean().item()
        assert steps.max().item() <= 1 and same > 0.999, (n, steps.max().item(), same)


def _code_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many float8 e4m3 codes apart two float8 tensors are, element by element (0: equal, 1:
    neighbours, also below 2**-6 where neighbours are 2**-9 apart, far more than 13%)."""
    def ordered(q: torch.Tensor) -> torch.Tensor:
        bits = q.view(torch.uint8).int()
        return torch.where(bits >= 0x80, -(bits & 0x7F), bits & 0x7F)
    return (ordered(got) - ordered(want)).abs()


def _within_one_bf16_unit(got: torch.Tensor, want: torch.Tensor, exact_share: float, what: str) -> None:
    """Every value within one bf16 unit of the last place (2**-7 relative), and at least
    `exact_share` of them equal (within fp32's last bits)."""
    close = torch.isclose(got, want, rtol=2**-7, atol=0)
    exact = torch.isclose(got, want, rtol=1e-6, atol=0).float().mean().item()
    assert close.all() and exact >= exact_share, (what, (~close).sum().item(), exact)
