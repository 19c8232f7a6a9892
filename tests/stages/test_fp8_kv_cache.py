"""`talker.kv_cache_dtype: fp8`: the paged KV cache in float8 e4m3, values saturated at its range,
read back by every attention path as the queries' dtype; a served talker's outputs stay near the
full-precision cache's."""

import torch

from profiles import load_profile
from stages.models.local_v15.runner import load_talker_runner
from stages.runtime.attention.metadata import build_attention_metadata
from stages.runtime.kv_cache import PagedKVCache, store_kv
from tests.stages.test_local_v15_runner import mixed_requests, run
from tests.stages.test_qwen3 import CFG, make_model

FP8 = torch.float8_e4m3fn


def test_stores_saturate_at_the_float8_range_instead_of_nan():
    keys = torch.zeros(2, 4, 1, 3, dtype=FP8)  # [blocks, block_size, Hkv, D]
    values = torch.zeros_like(keys)
    k = torch.tensor([[[1000.0, -1000.0, 0.3]]])  # [N=1, Hkv, D]
    store_kv(keys, values, torch.tensor([5]), k, -k)
    assert keys[1, 1, 0].float().tolist() == [448.0, -448.0, float(torch.tensor(0.3).to(FP8).float())]
    assert values[1, 1, 0].float().tolist()[:2] == [-448.0, 448.0]
    assert not keys.float().isnan().any() and keys.float().count_nonzero() == 3


@torch.no_grad()
def test_paged_steps_over_a_float8_cache_stay_near_the_full_precision_cache():
    """Three sequences prefilled in chunks, then decoding, once over an fp32 cache and once over
    a float8 one: every new token's hidden state within a few percent."""
    model = make_model()
    torch.manual_seed(1)
    embeds = {s: torch.randn(n, CFG.hidden_size) for s, n in {0: 13, 1: 6, 2: 21}.items()}
    outs = {}
    for dtype in (torch.float32, FP8):
        cache = PagedKVCache(CFG.kv_cache_spec(num_blocks=32, block_size=4), dtype=dtype, device="cpu")
        done, got = dict.fromkeys(embeds, 0), []
        while any(done[s] < len(e) for s, e in embeds.items()):
            batch = [(s, min(1 if done[s] >= 5 else 5, len(e) - done[s])) for s, e in embeds.items()
                     if done[s] < len(e)]
            meta = build_attention_metadata(cache, batch, "cpu")
            got.append(model(torch.cat([embeds[s][done[s]:done[s] + n] for s, n in batch]), meta, cache))
            for s, n in batch:
                done[s] += n
        assert cache.keys[0].dtype == dtype
        outs[dtype] = torch.cat(got)
    rel = ((outs[FP8] - outs[torch.float32]).norm() / outs[torch.float32].norm()).item()
    assert 0 < rel < 0.05, rel


def test_a_runner_built_with_a_float8_cache_serves_every_request(local_v15_dir):
    """From the profile: the runner's pool is float8, and the mixed requests run to their ends
    (the forced ones to their lengths)."""
    reqs = mixed_requests(local_v15_dir)
    runner = load_talker_runner(local_v15_dir, load_profile("cpu", ["talker.kv_cache_dtype=fp8"]), "cpu")
    assert runner.cache.keys[0].dtype == FP8 and runner.cache.values[-1].dtype == FP8
    frames, finish = run(runner, reqs)
    assert set(finish) == set(reqs)
    for rid, (_, params) in reqs.items():
        if params.forced_frames is not None:
            assert len(frames[rid]) == params.forced_frames, rid
