"""`talker.fused_kv_writes`: each backbone layer stores its new keys and values in the paged cache
inside its first half (compiled: from the kernels that compute them), the same values in the same
slots as the two copies after it; through a served runner, the same frames."""

import numpy as np
import pytest
import torch

from profiles import load_profile
from stages.models.local_v15.runner import load_talker_runner
from stages.runtime.attention.metadata import build_attention_metadata
from stages.runtime.kv_cache import PagedKVCache, scatter_kv, store_kv
from tests.stages.test_local_v15_runner import mixed_requests, run
from tests.stages.test_qwen3 import CFG, make_model


@torch.no_grad()
def _serve(model) -> tuple[list[torch.Tensor], PagedKVCache]:
    """Three sequences prefilled in chunks, then decoded token by token beside a late joiner."""
    torch.manual_seed(1)
    cache = PagedKVCache(CFG.kv_cache_spec(num_blocks=24, block_size=4), dtype=torch.float32, device="cpu")
    outs = []
    for batch in ([(0, 7), (1, 5)], [(0, 1), (1, 1), (2, 9)], [(0, 1), (1, 1), (2, 1)], [(2, 1)]):
        meta = build_attention_metadata(cache, batch, "cpu")
        outs.append(model(torch.randn(sum(n for _, n in batch), CFG.hidden_size), meta, cache))
    return outs, cache


@pytest.mark.parametrize("compiler", [None, "eager", "inductor"])
def test_stores_in_the_layers_leave_the_cache_and_outputs_as_the_copies_after_them(compiler):
    """Eager, traced by dynamo, and compiled by inductor (C++ on the CPU): every output and every
    cache block as with the copies after each layer's first half (inductor: up to rounding)."""
    want, want_cache = _serve(make_model())
    model = make_model()
    if compiler:
        model.compile_layers(compiler)
    model.store_kv_in_layers()
    got, cache = _serve(model)
    exact = compiler != "inductor"
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)
    for layer in range(CFG.num_layers):
        torch.testing.assert_close(cache.keys[layer], want_cache.keys[layer], **tol)
        torch.testing.assert_close(cache.values[layer], want_cache.values[layer], **tol)
    assert cache.keys[0].abs().sum() > 0 and cache.values[-1].abs().sum() > 0  # written at all


def test_a_runner_with_fused_kv_writes_makes_the_same_frames(local_v15_dir):
    """Eight requests of mixed settings through runners built from the profile both ways."""
    reqs = mixed_requests(local_v15_dir)
    frames, finish = {}, {}
    for fused in (False, True):
        runner = load_talker_runner(local_v15_dir, load_profile("cpu", [f"talker.fused_kv_writes={fused}"]), "cpu")
        assert runner.model.transformer.kv_stores_in_layers == fused
        frames[fused], finish[fused] = run(runner, reqs)
    assert finish[True] == finish[False] and len(finish[False]) == len(reqs)
    for rid in reqs:
        np.testing.assert_array_equal(frames[True][rid], frames[False][rid], err_msg=str(rid))

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_the_compiled_layers_scatter_stores_what_the_copies_store(dtype, compiled):
    """`scatter_kv` (the compiled layer half's stores, an in-place `index_put_` at block and row),
    called eagerly and compiled by inductor (a float8 pool then written as float8, not as bytes),
    leaves both pools exactly as `store_kv`'s copies into their flat view do, slots on and off
    block edges, float8 saturation included."""
    torch.manual_seed(0)
    first = [torch.randn(6, 4, 2, 8).to(dtype) for _ in range(2)]  # keys, values [blocks, 4, Hkv, D]
    pools = [first, [p.clone() for p in first]]
    slots = torch.tensor([0, 3, 4, 13, 23])
    k, v = torch.randn(5, 2, 8) * 300, torch.randn(5, 2, 8)
    store_kv(*pools[0], slots, k, v)
    (torch.compile(scatter_kv, dynamic=True) if compiled else scatter_kv)(*pools[1], slots, k, v)
    for a, b in zip(*pools):
        assert torch.equal(a.view(torch.uint8) if dtype == FP8 else a, b.view(torch.uint8) if dtype == FP8 else b)
    assert torch.equal(pools[1][1].view(-1, 2, 8)[slots].float(), v.to(dtype).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pool_dtype", [torch.float32, FP8])
@torch.no_grad()
def test_the_compiled_layer_half_stores_in_place_on_cuda(pool_dtype):
    """Compiled by inductor for CUDA, the layer half with the KV stores (`talker.fused_kv_writes`)
    writes the new rows into the pools and nothing else, a float8 pool too: no kernel that copies
    a pool back (index_copy_ into a flat view of the pool was lowered to one, 5.4 ms a step at 88
    rows; a float8 cache with the stores ran 3.4 ms a step slower than bf16)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from stages.models.qwen3 import attention_inputs_stored, rope_cos_sin

    layer = make_model().layers[0].cuda()
    keys = torch.zeros(4096, 16, CFG.num_kv_heads, CFG.head_dim, device="cuda", dtype=pool_dtype)
    values = torch.zeros_like(keys)
    x = torch.randn(5, CFG.hidden_size, device="cuda")
    cos, sin = rope_cos_sin(torch.arange(5, device="cuda"), CFG.head_dim, CFG.rope_theta, x.dtype)
    slots = torch.tensor([3, 40, 77, 500, 60000], device="cuda")
    compiled = torch.compile(attention_inputs_stored, dynamic=True)
    _, code = run_and_get_code(compiled, layer, x, cos, sin, keys, values, slots)
    kernels = set(re.findall(r"def (triton_\w+)\(", "\n".join(code)))
    # a copy of a pool is named `..._copy_...` or `..._index_copy_...`; `_to_copy` is a cast (the
    # float8 rows' conversion before their store), not a copy of anything
    copies = [k for k in kernels if re.search(r"(?<!_to)_copy_", k)]
    assert kernels and not copies, kernels
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    compiled(layer, x, cos, sin, keys, values, slots)  # a pool rewritten out of place needs its size again
    torch.cuda.synchronize()
    pool_bytes = keys.numel() * keys.element_size()
    assert torch.cuda.max_memory_allocated() - before < pool_bytes // 4
    stored = keys.float()  # float8 has no eager abs or count_nonzero
    want_k = stored.view(-1, CFG.num_kv_heads, CFG.head_dim)[slots]
    assert want_k.abs().sum() > 0 and stored.count_nonzero() == want_k.count_nonzero()
