"""`talker.fp8_fused_scales`: a float8 layer's q|k|v scales applied by the q/k norm, RoPE and
store kernel as it loads the product, and down's inside the next norm, on the CPU through
Triton's interpreter: the kernel against the same kernel on scaled projections, a model's
serving path (eager and compiled) against the float8 model that scales after each matmul,
and a runner built from the profile."""

from tests import triton_cpu  # noqa: F401  (first: Triton's interpreter without a GPU)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from profiles import load_profile  # noqa: E402
from profiles.schema import ProfileError  # noqa: E402
from stages.models.local_v15.runner import load_talker_runner  # noqa: E402
from stages.models.qwen3 import fuse_projections  # noqa: E402
from stages.runtime.fp8_linear import quantize_linears  # noqa: E402
# the kernels' modules imported here, under the interpreter: a model imports them when asked,
# and one asked first with TRITON_INTERPRET unset (the test of the torch ops' path) would make
# them compiled kernels, which cannot launch without a GPU
import stages.runtime.fp8_norm  # noqa: E402,F401
import stages.runtime.fp8_swiglu  # noqa: E402,F401
from stages.runtime.qk_rope_store import qk_norm_rope_store  # noqa: E402
from tests.stages.test_fused_kv_writes import _serve  # noqa: E402
from tests.stages.test_local_v15_runner import mixed_requests, run  # noqa: E402
from tests.stages.test_qk_rope_store import BLOCK, HKV, HQ, D, N, _case  # noqa: E402
from tests.stages.test_qwen3 import CFG, make_model  # noqa: E402


@pytest.mark.parametrize("fused", [True, False])
def test_the_kernel_scales_a_float8_product_as_it_loads(fused):
    """A product with its rows' and channels' scales given: the queries and the cache the
    kernel leaves from the product scaled beforehand (fp32: to the last bits)."""
    (q, k, v, q_w, k_w, cos, sin), slots = _case(torch.float32, fused)
    g = torch.Generator().manual_seed(5)
    row = torch.rand(N, 1, generator=g) + 0.5
    col = torch.rand(1, (HQ + 2 * HKV) * D, generator=g) + 0.5
    cq, ck, cv = col.split((HQ * D, HKV * D, HKV * D), dim=-1)
    pools = [[torch.zeros(6, BLOCK, HKV, D) for _ in range(2)] for _ in range(2)]
    got = qk_norm_rope_store(q, k, v, q_w, k_w, 1e-6, cos, sin, *pools[0], slots, row, col)
    want = qk_norm_rope_store(q * (row * cq), k * (row * ck), v * (row * cv), q_w, k_w, 1e-6, cos, sin,
                              *pools[1], slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(*pools):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert pools[0][1].abs().sum() > 0
    with pytest.raises(ValueError, match="scales"):
        qk_norm_rope_store(q, k, v, q_w, k_w, 1e-6, cos, sin, *pools[0], slots, row, col[:, :-1])


def _float8_model(scales_later: bool, compiler: str | None = None):
    """The tiny backbone with fused float8 projections (w8a8, the MLP's SiLU product by its
    kernel), storing by the kernel with the residual sums deferred; the scales left to the
    kernels after the matmuls or not."""
    model = make_model()
    fuse_projections(model)
    quantize_linears(model, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), "w8a8")
    assert model.use_fp8_swiglu() == CFG.num_layers
    if compiler:
        model.compile_layers(compiler)
    model.store_kv_by_kernel()
    model.defer_residuals()
    assert model.use_fp8_scales_later(scales_later) == (2 * CFG.num_layers if scales_later else 0)
    return model


def assert_served_alike(got, cache, want, want_cache, tol: float) -> None:
    """Every output of `_serve` and every layer's cache blocks within `tol` of the other model's."""
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    for layer in range(CFG.num_layers):
        torch.testing.assert_close(cache.keys[layer], want_cache.keys[layer], rtol=tol, atol=tol)
        torch.testing.assert_close(cache.values[layer], want_cache.values[layer], rtol=tol, atol=tol)


@pytest.mark.parametrize("compiler", [None, "inductor"])
def test_a_model_leaving_its_scales_to_the_kernels_serves_as_one_scaling_after_each_matmul(compiler):
    """Prefill chunks, decode tokens and a late joiner, eager and compiled (inductor, C++ on the
    CPU): every output and cache block as the float8 model that scales each product after its
    matmul (the same fp32 products and scales)."""
    want, want_cache = _serve(_float8_model(False))
    got, cache = _serve(_float8_model(True, compiler))
    assert_served_alike(got, cache, want, want_cache, 1e-4)


def test_where_triton_cannot_run_the_model_scales_by_the_torch_ops(monkeypatch):
    """On a CPU without Triton's interpreter the scales left for the kernel are applied by the
    torch ops: the same outputs and cache."""
    if torch.cuda.is_available():
        pytest.skip("the CPU's path")
    monkeypatch.delenv("TRITON_INTERPRET")
    want, want_cache = _serve(_float8_model(False))
    got, cache = _serve(_float8_model(True))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.values[-1], want_cache.values[-1], rtol=1e-4, atol=1e-4)


def test_only_unbiased_w8a8_layers_leave_their_scales():
    """Bf16 layers and w8a16 keep scaling (or not) as they did."""
    model = make_model()
    assert model.use_fp8_scales_later() == 0
    fuse_projections(model)
    quantize_linears(model, ("qkv_proj", "down_proj"), "w8a16")
    assert model.use_fp8_scales_later() == 0
    assert not any(layer.self_attn.qkv_scales_later or layer.mlp.down_scales_later for layer in model.layers)


def test_the_profile_asks_for_float8_w8a8_and_the_deferred_sums():
    with pytest.raises(ProfileError, match="fp8_fused_scales needs"):
        load_profile("cpu", ["talker.fp8_fused_scales=true", "talker.fp8_weights=backbone",
                             "talker.fp8_scheme=w8a8"])
    load_profile("cpu", ["talker.fp8_fused_scales=true", "talker.fp8_weights=backbone", "talker.fp8_scheme=w8a8",
                         "talker.fused_qk_rope_store=true", "talker.deferred_residuals=true"])


def test_a_runner_leaving_its_scales_to_the_kernels_makes_the_same_frames(local_v15_dir):
    """Four requests of mixed settings and prompt lengths through float8 runners built from the
    profile with the scales after each matmul and left to the kernels: the same frames."""
    reqs = dict(list(mixed_requests(local_v15_dir).items())[:4])
    args = ["talker.fp8_weights=backbone", "talker.fp8_scheme=w8a8", "talker.fused_projections=true",
            "talker.fused_qk_rope_store=true", "talker.deferred_residuals=true"]
    frames, finish = {}, {}
    for on in (False, True):
        runner = load_talker_runner(local_v15_dir, load_profile("cpu", args + [f"talker.fp8_fused_scales={on}"]), "cpu")
        layers = runner.model.transformer.layers
        assert all(layer.self_attn.qkv_scales_later == layer.mlp.down_scales_later == on for layer in layers)
        frames[on], finish[on] = run(runner, reqs)
    assert finish[True] == finish[False] and len(finish[False]) == len(reqs)
    for rid in reqs:
        np.testing.assert_array_equal(frames[True][rid], frames[False][rid], err_msg=str(rid))
