"""`talker.fp8_fused_swiglu`: a float8 MLP's SiLU product and its quantization for down in one
Triton kernel (`stages.runtime.fp8_swiglu`), on the CPU through Triton's interpreter: the
kernel against the torch ops, an MLP through it against the float8 MLP without it, and a runner
built from the profile serving its requests."""

from tests import triton_cpu  # noqa: F401  (first: Triton's interpreter without a GPU)

import pytest  # noqa: E402
import torch  # noqa: E402

from profiles import load_profile  # noqa: E402
from profiles.schema import ProfileError  # noqa: E402
from stages.models.local_v15.runner import load_talker_runner  # noqa: E402
from stages.models.qwen3 import Qwen3MLP, fuse_projections  # noqa: E402
from stages.runtime.fp8_linear import FP8, Fp8Linear, quantize_linears  # noqa: E402
from stages.runtime.fp8_swiglu import silu_mul_quant, silu_mul_quant_torch  # noqa: E402
from tests.stages.test_fp8_weights import assert_same_ends  # noqa: E402
from tests.stages.test_local_v15_runner import mixed_requests  # noqa: E402
from tests.stages.test_qwen3 import CFG  # noqa: E402


def _product(m: int, i: int, seed: int = 0):
    """gate|up's product before its scales [m, 2i] (an all-zero row among them), its input rows'
    scales [m, 1] and its channels' [2i], as a float8 layer leaves them on the CPU."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(m, 2 * i, generator=g) * 4000.0  # |raw| up to in * 448^2: large
    raw[1:2] = 0.0
    x_scale = torch.rand(m, 1, generator=g) * 1e-3 + 1e-4
    w_scale = torch.rand(2 * i, generator=g) * 1e-3 + 1e-4
    return raw, x_scale, w_scale


@torch.no_grad()
@pytest.mark.parametrize("i", [48, 128])
def test_the_kernel_quantizes_the_silu_product_as_the_torch_ops(i):
    """Rows of any width (48: a row masked past its end): the same rows' scales and float8
    values as the torch ops in fp32, an all-zero row as zeros with a finite scale."""
    raw, x_scale, w_scale = _product(5, i)
    h, h_scale = silu_mul_quant(raw, x_scale, w_scale)
    want, want_scale = silu_mul_quant_torch(raw, x_scale, w_scale, torch.float32)
    assert h.shape == (5, i) and h.dtype == FP8 and h_scale.shape == (5, 1) and h_scale.dtype == torch.float32
    torch.testing.assert_close(h_scale, want_scale, rtol=1e-5, atol=0)
    # the same float8 codes, except that Triton's CPU interpreter rounds a value just under a power
    # of two to half that power (its float8 cast drops the mantissa's carry; CUDA's does not:
    # the GPU test), and where SiLU's last bit moves a value across a rounding edge
    got, ref = h.float(), want.float()
    dropped_carry = (got == ref / 2) & (torch.log2(ref.abs()).frac() == 0)
    neighbour = torch.isclose(got, ref, rtol=0.13, atol=0)
    assert (dropped_carry | neighbour).all() and (got == ref).float().mean() > 0.97
    assert torch.all(h[1].float() == 0) and torch.isfinite(h_scale).all()
    gate, up = (raw * (x_scale * w_scale)).chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    got = h.float() * h_scale
    assert ((got - exact).norm() / exact.norm()).item() < 0.05


def test_no_rows_no_launch():
    h, h_scale = silu_mul_quant(*_product(0, 48))
    assert h.shape == (0, 48) and h_scale.shape == (0, 1)


def _mlps():
    """A fused float8 MLP (w8a8) and its twin through the kernel, from the same weights."""
    torch.manual_seed(0)
    plain = Qwen3MLP(CFG).eval()
    plain.fuse_projections()
    quantize_linears(plain, ("gate_up_proj", "down_proj"), "w8a8")
    fused = Qwen3MLP(CFG).eval()
    fused.fuse_projections()
    quantize_linears(fused, ("gate_up_proj", "down_proj"), "w8a8")
    fused.load_state_dict(plain.state_dict())
    return plain, fused


@torch.no_grad()
def test_an_mlp_through_the_kernel_computes_the_float8_mlp():
    """The MLP's output through the kernel is the float8 MLP's without it, for tokens in any
    leading shape: exactly by the torch ops, and by the kernel to the rounding of a few float8
    values (here also those the interpreter's cast halves: the test above)."""
    plain, fused = _mlps()
    assert fused.use_fp8_swiglu() and fused.fp8_swiglu_by_kernel
    x = torch.randn(3, 7, CFG.hidden_size)
    got, want = fused(x), plain(x)
    assert got.shape == want.shape == (3, 7, CFG.hidden_size)
    assert ((got - want).norm() / want.norm()).item() < 0.1
    fused.fp8_swiglu_by_kernel = False
    assert torch.equal(fused(x), want)
    assert not fused.use_fp8_swiglu(False) and torch.equal(fused(x), want)


def test_only_float8_w8a8_mlps_take_the_kernel():
    """Bf16 layers, the unfused gate and up, or w8a16 keep their own path."""
    mlp = Qwen3MLP(CFG)
    assert not mlp.use_fp8_swiglu()
    mlp.fuse_projections()
    assert not mlp.use_fp8_swiglu()
    quantize_linears(mlp, ("gate_up_proj", "down_proj"), "w8a16")
    assert not mlp.use_fp8_swiglu() and mlp.fp8_swiglu is None
    unfused = Qwen3MLP(CFG)
    quantize_linears(unfused, ("gate_proj", "up_proj", "down_proj"), "w8a8")
    assert not unfused.use_fp8_swiglu()


def test_the_profile_asks_for_float8_w8a8_fused_projections():
    with pytest.raises(ProfileError, match="fp8_fused_swiglu needs"):
        load_profile("cpu", ["talker.fp8_fused_swiglu=true"])
    with pytest.raises(ProfileError, match="fp8_fused_swiglu needs"):
        load_profile("cpu", ["talker.fp8_fused_swiglu=true", "talker.fp8_weights=backbone",
                             "talker.fused_projections=true"])
    load_profile("cpu", ["talker.fp8_fused_swiglu=true", "talker.fp8_weights=backbone",
                         "talker.fp8_scheme=w8a8", "talker.fused_projections=true"])


@torch.no_grad()
def test_a_runner_with_the_kernel_serves_the_float8_talkers_requests(local_v15_dir):
    """Built from the profile, every backbone MLP takes the kernel and the runner serves the mixed
    requests to the ends the float8 runner without it reaches (forced lengths exact)."""
    args = ["talker.fp8_weights=backbone", "talker.fp8_scheme=w8a8", "talker.fused_projections=true"]
    reqs = mixed_requests(local_v15_dir)
    plain = load_talker_runner(local_v15_dir, load_profile("cpu", args), "cpu")
    runner = load_talker_runner(local_v15_dir, load_profile("cpu", args + ["talker.fp8_fused_swiglu=true"]), "cpu")
    layers = runner.model.transformer.layers
    assert all(layer.mlp.fp8_swiglu is not None and layer.mlp.fp8_swiglu_by_kernel for layer in layers)
    assert all(isinstance(layer.mlp.down_proj, Fp8Linear) for layer in layers)
    assert all(layer.mlp.fp8_swiglu is None for layer in plain.model.transformer.layers)
    assert_same_ends(runner, plain, reqs)


def test_fuse_projections_leaves_the_float8_path_to_be_asked_for():
    """A model's MLPs take the kernel only once asked (`Qwen3Model.use_fp8_swiglu`)."""
    from stages.models.qwen3 import Qwen3Model

    model = Qwen3Model(CFG)
    fuse_projections(model)
    quantize_linears(model, ("gate_up_proj", "down_proj"), "w8a8")
    assert all(layer.mlp.fp8_swiglu is None for layer in model.layers)
    assert model.use_fp8_swiglu() == CFG.num_layers
    assert model.use_fp8_swiglu(False) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_on_cuda_the_kernel_quantizes_the_silu_product_as_the_torch_ops():
    """CUDA: the served width (9,728 columns a row, one program holding it) from bf16 products
    at a decode step's few rows and a prefill's many: the rows' scales and float8 codes of the
    torch ops in fp32 (a code off by one where the SiLU's last bit crosses a rounding edge)."""
    i = 9728
    for m in (1, 48, 300):
        raw, x_scale, w_scale = (t.cuda() for t in _product(m + 2, i))
        raw = raw.to(torch.bfloat16)
        h, h_scale = silu_mul_quant(raw, x_scale, w_scale)
        want, want_scale = silu_mul_quant_torch(raw, x_scale, w_scale, torch.float32)
        torch.testing.assert_close(h_scale, want_scale, rtol=1e-5, atol=0)
        got, ref = h.float(), want.float()
        assert torch.isclose(got, ref, rtol=0.13, atol=0).all() and (got == ref).float().mean() > 0.999, m
