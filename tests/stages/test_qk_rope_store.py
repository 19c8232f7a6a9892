"""`talker.fused_qk_rope_store`: a backbone layer's q/k norms, RoPE and KV stores in one Triton
kernel (`stages.runtime.qk_rope_store`), on the CPU through Triton's interpreter: the queries
and the cache as the torch ops leave them, in a model's serving path (with the residual sums
deferred to the next norm too: `talker.deferred_residuals`), and through a runner built from
the profile."""

from tests import triton_cpu  # noqa: F401  (first: Triton's interpreter without a GPU)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from profiles import load_profile  # noqa: E402
from stages.models.local_v15.runner import load_talker_runner  # noqa: E402
from stages.models.qwen3 import apply_rope_neox, rope_cos_sin  # noqa: E402
from stages.runtime.batch_invariant import rms_norm  # noqa: E402
from stages.runtime.kv_cache import store_kv  # noqa: E402
from stages.runtime.qk_rope_store import qk_norm_rope_store  # noqa: E402
from tests.stages.test_fused_kv_writes import _serve  # noqa: E402
from tests.stages.test_local_v15_runner import mixed_requests, run  # noqa: E402
from tests.stages.test_qwen3 import CFG, make_model  # noqa: E402

FP8 = torch.float8_e4m3fn
N, HQ, HKV, D, BLOCK = 5, 4, 2, 16, 4


def _case(dtype, fused: bool, device="cpu"):
    """Projections (views of one q|k|v matmul's output when `fused`), norm weights, RoPE tables
    at positions 3.., and slots on and off block edges read through a strided view, as a decode
    graph's packed inputs hold them."""
    g = torch.Generator().manual_seed(7)
    qkv = (torch.randn(N, (HQ + 2 * HKV) * D, generator=g) * 3).to(dtype)
    q, k, v = qkv.split((HQ * D, HKV * D, HKV * D), dim=-1)
    if not fused:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    weights = [torch.randn(D, generator=g).to(dtype) for _ in range(2)]
    cos, sin = rope_cos_sin(torch.arange(N) + 3, D, 10000.0, dtype)
    packed = torch.zeros(N, 6, dtype=torch.int64)
    packed[:, 3] = torch.tensor([0, 3, 4, 13, 23])
    args = [t.to(device) for t in (q, k, v, *weights, cos, sin)]
    return args, packed.to(device)[:, 3]


def _reference(q, k, v, q_w, k_w, cos, sin, keys, values, slots):
    q = apply_rope_neox(rms_norm(q.reshape(N, HQ, D), q_w, 1e-6), cos, sin)
    k = apply_rope_neox(rms_norm(k.reshape(N, HKV, D), k_w, 1e-6), cos, sin)
    store_kv(keys, values, slots.contiguous(), k, v.reshape(N, HKV, D))
    return q


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, FP8)])
def test_the_kernel_leaves_the_queries_and_the_cache_as_the_torch_ops(dtype, pool_dtype, fused):
    """Queries normed and rotated, keys normed, rotated and stored, values stored, at their slots
    and nowhere else: exact in fp32; bf16 and a float8 cache within a unit of their last place
    (the torch ops round the rotation's products to bf16, the kernel once; a float8 tie may round
    either way in the interpreter), float8 saturated rather than NaN."""
    (q, k, v, q_w, k_w, cos, sin), slots = _case(dtype, fused)
    if pool_dtype == FP8:
        v[1, :D] = 1e4  # past float8's range: stored as its largest value
    pools = [[torch.zeros(6, BLOCK, HKV, D).to(pool_dtype) for _ in range(2)] for _ in range(2)]
    got = qk_norm_rope_store(q, k, v, q_w, k_w, 1e-6, cos, sin, *pools[0], slots)
    want = _reference(q, k, v, q_w, k_w, cos, sin, *pools[1], slots)
    assert got.shape == (N, HQ, D) and got.dtype == dtype
    exact, bf16 = dict(rtol=1e-6, atol=1e-6), dict(rtol=1e-2, atol=1e-2)  # bf16: a step is 1/128 of a value
    q_tol = exact if dtype == torch.float32 else bf16
    pool_tol = dict(rtol=0.13, atol=0.02) if pool_dtype == FP8 else q_tol  # float8: 1/8
    torch.testing.assert_close(got.float(), want.float(), **q_tol)
    for mine, theirs in zip(*pools):
        torch.testing.assert_close(mine.float(), theirs.float(), **pool_tol)
        assert torch.equal(mine.float() != 0, theirs.float() != 0)  # the same slots written
    if pool_dtype == FP8:
        assert pools[0][1].float().max() == torch.finfo(FP8).max


@pytest.mark.parametrize("deferred", [False, True])
def test_a_compiled_model_storing_by_the_kernel_serves_as_one_that_copies(deferred):
    """Prefill chunks, decode tokens and a late joiner through the serving path with the layer
    halves compiled (inductor, C++ on the CPU; the runner test below runs them eagerly), the
    residual sums in place or deferred to the next norm: every output and cache block as with
    the torch ops and the copies after them."""
    want, want_cache = _serve(make_model())
    model = make_model()
    model.compile_layers("inductor")
    model.store_kv_by_kernel()
    model.defer_residuals(deferred)
    got, cache = _serve(model)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for layer in range(CFG.num_layers):
        torch.testing.assert_close(cache.keys[layer], want_cache.keys[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.values[layer], want_cache.values[layer], rtol=1e-5, atol=1e-5)


def test_where_triton_cannot_run_the_model_takes_the_torch_ops(monkeypatch):
    """On a CPU without Triton's interpreter the option serves through the torch ops: the same
    outputs and cache, the residual sums deferred too."""
    if torch.cuda.is_available():
        pytest.skip("the CPU's path")
    want, want_cache = _serve(make_model())
    monkeypatch.delenv("TRITON_INTERPRET")
    model = make_model()
    model.store_kv_by_kernel()
    model.defer_residuals()
    got, cache = _serve(model)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.keys[-1], want_cache.keys[-1], rtol=1e-5, atol=1e-5)


def test_a_runner_with_the_kernel_makes_the_same_frames(local_v15_dir):
    """Four requests of mixed settings and prompt lengths through runners built from the
    profile both ways, the kernel with the residual sums deferred (four requests: each step's
    kernels run in Triton's interpreter here)."""
    reqs = dict(list(mixed_requests(local_v15_dir).items())[:4])
    frames, finish = {}, {}
    for on in (False, True):
        overrides = [f"talker.fused_qk_rope_store={on}", f"talker.deferred_residuals={on}"]
        runner = load_talker_runner(local_v15_dir, load_profile("cpu", overrides), "cpu")
        assert runner.model.transformer.kv_stores_by_kernel == on
        assert runner.model.transformer.residuals_deferred == on
        frames[on], finish[on] = run(runner, reqs)
    assert finish[True] == finish[False] and len(finish[False]) == len(reqs)
    for rid in reqs:
        np.testing.assert_array_equal(frames[True][rid], frames[False][rid], err_msg=str(rid))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, FP8])
@torch.no_grad()
def test_on_cuda_the_kernel_replays_from_a_graph_as_the_torch_ops(pool_dtype):
    """bf16 on CUDA, launched eagerly and replayed from a CUDA graph with new projections: the
    queries and both pools as the torch ops leave them (within bf16's and float8's rounding)."""
    (q, k, v, q_w, k_w, cos, sin), slots = _case(torch.bfloat16, True, "cuda")
    pools = [[torch.zeros(6, BLOCK, HKV, D, device="cuda").to(pool_dtype) for _ in range(2)] for _ in range(2)]
    qk_norm_rope_store(q, k, v, q_w, k_w, 1e-6, cos, sin, *pools[0], slots)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = qk_norm_rope_store(q, k, v, q_w, k_w, 1e-6, cos, sin, *pools[0], slots)
    for x in (q, k, v):
        x.mul_(-0.5)
    graph.replay()
    want = _reference(q, k, v, q_w, k_w, cos, sin, *pools[1], slots)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    tol = dict(rtol=0.13, atol=0.02) if pool_dtype == FP8 else dict(rtol=1e-2, atol=1e-2)
    for mine, theirs in zip(*pools):
        torch.testing.assert_close(mine.float(), theirs.float(), **tol)


def test_deferred_residuals_need_the_kernel_path():
    with pytest.raises(Exception, match="deferred_residuals needs talker.fused_qk_rope_store"):
        load_profile("cpu", ["talker.deferred_residuals=true"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_on_cuda_the_deferred_layer_half_makes_no_addmm():
    """Compiled by inductor for CUDA, the layer's second half with its residual sums deferred
    calls no `addmm` (whose out-of-place form copies its input first), where the summing half
    calls two; both give the same MLP input norm."""
    from torch._inductor.utils import run_and_get_code

    from stages.models.qwen3 import attention_outputs, attention_outputs_deferred

    layer = make_model().layers[0].cuda().to(torch.bfloat16)
    x = torch.randn(6, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
    o = torch.randn(6, CFG.num_heads, CFG.head_dim, device="cuda", dtype=torch.bfloat16)
    (o_out, mlp), deferred = run_and_get_code(torch.compile(attention_outputs_deferred, dynamic=True), layer, x, o)
    summed, plain = run_and_get_code(torch.compile(attention_outputs, dynamic=True), layer, x, o)
    assert "addmm" not in "\n".join(deferred) and "addmm" in "\n".join(plain)
    torch.testing.assert_close((x.float() + o_out.float() + mlp.float()), summed.float(), rtol=2e-2, atol=2e-2)
