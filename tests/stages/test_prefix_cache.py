"""Prompt prefix caching: content keys, the cache's named and idle blocks, and runners that start a
request from an earlier prompt's blocks giving exactly the codes they give without the cache."""

import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from stages.models.delay.model import DelayModel
from stages.models.delay.runner import DelayRunner
from stages.models.local_v15.runner import LocalV15Runner
from stages.runtime.kv_cache import KVCacheSpec, PagedKVCache
from stages.runtime.prefix_cache import block_keys
from tests.conftest import golden_dir
from tests.stages.runner_drive import drive


def test_block_keys_name_a_block_and_everything_before_it():
    rows = np.arange(10 * 3, dtype=np.int64).reshape(10, 3)
    keys = block_keys(rows, 4)
    assert len(keys) == 2 and len(set(keys)) == 2  # the 2 rows of the partial block are not named
    assert block_keys(rows[:8], 4) == keys and block_keys(rows[:9], 4) == keys
    later = rows.copy()
    later[5, 0] += 1  # a change in block 1 keeps block 0's key
    assert block_keys(later, 4)[0] == keys[0] and block_keys(later, 4)[1] != keys[1]
    earlier = rows.copy()
    earlier[0, 2] += 1  # a change in block 0 changes every key after it
    assert not set(block_keys(earlier, 4)) & set(keys)
    assert block_keys(rows.reshape(15, 2)[:8], 4)[0] != keys[0]  # another row width never matches


def small_cache(num_blocks=6):
    return PagedKVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=4),
                        dtype=torch.float32, device="cpu", prefix_caching=True)


def test_named_blocks_outlive_their_request_and_are_reused_last():
    cache = small_cache()
    keys = block_keys(np.arange(13 * 2, dtype=np.int64).reshape(13, 2), 4)  # 3 full blocks
    cache.append_slots(1, 13)  # blocks 0-3
    assert cache.name_blocks(1, keys, 0) == 3 and cache.prefix.num_named == 3
    cache.free(1)
    assert cache.num_free_blocks == 6 and cache.prefix.num_idle == 3 and cache.allocator.num_free == 3
    # a request with the same first 2 blocks starts with them, holding them
    assert cache.attach_prefix(2, keys, max_blocks=2) == 8
    assert cache.block_table(2) == [0, 1] and cache.length(2) == 8 and cache.prefix.num_idle == 1
    assert cache.attach_prefix(2, keys, max_blocks=2) == 0  # holds blocks already: nothing to attach
    cache.append_slots(2, 5)  # blocks 3 and 4 from the free list: the idle block 2 stays
    assert cache.block_table(2) == [0, 1, 3, 4] and cache.prefix.num_idle == 1
    cache.append_slots(3, 8)  # block 5, then the free list is empty: the idle block is reused, unnamed
    assert sorted(cache.block_table(3)) == [2, 5] and cache.prefix.num_idle == 0 and cache.prefix.num_named == 2
    assert cache.attach_prefix(4, keys, max_blocks=3) == 8  # the run stops where block 2 was lost
    cache.free(2)
    cache.free(4)
    cache.free(3)
    assert cache.num_free_blocks == 6 and cache.prefix.num_idle == 2


def test_without_prefix_caching_nothing_is_kept():
    cache = PagedKVCache(KVCacheSpec(1, 1, 2, 4, 4), dtype=torch.float32, device="cpu")
    keys = block_keys(np.zeros((9, 2), dtype=np.int64), 4)
    cache.append_slots(1, 9)
    assert cache.name_blocks(1, keys, 0) == 0
    cache.free(1)
    assert cache.attach_prefix(2, keys, 2) == 0 and cache.allocator.num_free == 4


def voice_prompts(golden):
    """The voice-clone prompt (75 rows) and one with the same voice and another text (its last
    rows changed): they share their first 64 rows."""
    with np.load(golden / "case_voice_clone.npz") as z:
        prompt = z["input_ids"]
    other = prompt.copy()
    other[66:, 0] = prompt[66:, 0][::-1]
    return prompt, other


@pytest.mark.parametrize("graph_path, prefill_graphs", [("off", False), ("eager", True)])
def test_local_v15_request_from_cached_blocks_equals_it_alone(local_v15_model, local_v15_dir, graph_path,
                                                             prefill_graphs):
    prompt, other = voice_prompts(local_v15_dir)
    params = [SamplingParams(seed=s, forced_frames=12, temperature=1.0, top_k=20) for s in (3, 4, 5)]
    arrivals = {0: [(1, prompt, params[0])], 3: [(2, other, params[1]), (3, prompt, params[2])]}
    kw = dict(max_running=4, kv_block_size=8, num_kv_blocks=64, prefill_chunk_tokens=24,
              max_prefill_tokens_per_step=48, graph_path=graph_path, prefill_graphs=prefill_graphs)
    cached = LocalV15Runner(local_v15_model, prefix_caching=True, **kw)
    with_cache = drive(cached, arrivals)
    # request 1's 9 full blocks were named as they filled; 2 shares 8 of them, 3 all 9
    assert cached.scheduler.cached_tokens == 64 + 72 and cached.scheduler.prompt_tokens == 3 * 75
    for rid, p, sp in (a for items in arrivals.values() for a in items):
        alone = drive(LocalV15Runner(local_v15_model, **kw), {0: [(rid, p, sp)]})
        np.testing.assert_array_equal(with_cache[rid], alone[rid], err_msg=str(rid))
    assert cached.cache.num_used_blocks == (graph_path != "off") and cached.cache.prefix.num_idle > 0


def test_local_v15_preempted_request_takes_its_blocks_back(local_v15_model, local_v15_dir):
    prompt, other = voice_prompts(local_v15_dir)
    reqs = {0: [(i, p, SamplingParams(seed=i, forced_frames=40)) for i, p in enumerate((prompt, other, prompt))]}
    roomy = drive(LocalV15Runner(local_v15_model, max_running=3, kv_block_size=8, num_kv_blocks=64), reqs)
    tight = LocalV15Runner(local_v15_model, max_running=3, kv_block_size=8, num_kv_blocks=30, prefix_caching=True)
    got = drive(tight, reqs)
    assert tight.preemptions > 0 and tight.scheduler.cached_tokens > 0
    for i in roomy:
        np.testing.assert_array_equal(got[i], roomy[i])


def test_delay_request_from_cached_blocks_equals_it_alone():
    root = golden_dir("moss_tts_delay")
    with np.load(root / "case_voice_clone.npz") as z:
        prompt = z["input_ids"]
    model = DelayModel.from_dir(root)
    params = SamplingParams(seed=9, temperature=1.0, top_k=20, max_new_frames=6)
    kw = dict(max_running=2, kv_block_size=8, num_kv_blocks=64, finish_on_audio_end=False)
    cached = DelayRunner(model, prefix_caching=True, **kw)
    both = drive(cached, {0: [(1, prompt, params)], 2: [(2, prompt, params)]})
    assert cached.scheduler.cached_tokens == (len(prompt) - 1) // 8 * 8
    alone = drive(DelayRunner(model, **kw), {0: [(2, prompt, params)]})
    np.testing.assert_array_equal(both[2], alone[2])
    np.testing.assert_array_equal(both[1], both[2])  # same prompt, same seed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_and_triton_attention_from_cached_blocks():
    """On the GPU path (decode and prefill graphs, the Triton paged attention), requests of one
    voice that start from cached blocks give the codes they give without the cache (tiny, fp32)."""
    from stages.models.local_v15.config import tiny_config
    from stages.models.local_v15.loader import build_talker_module
    from stages.runtime.attention.backends import make_attention

    torch.manual_seed(0)
    model = build_talker_module(tiny_config()).cuda().eval()
    rng = np.random.default_rng(0)
    voice = np.full((45, 13), 1024, np.int64)
    voice[:, 0] = rng.integers(0, 600, len(voice))
    arrivals = {}
    for i in range(6):  # one voice, six texts; two arrive at each of three steps
        text = np.full((10 + 3 * i, 13), 1024, np.int64)
        text[:, 0] = rng.integers(0, 600, len(text))
        arrivals.setdefault(4 * (i // 2), []).append(
            (i, np.concatenate([voice, text]), SamplingParams(seed=i, forced_frames=8)))
    kw = dict(max_running=8, num_kv_blocks=64, kv_block_size=8, prefill_chunk_tokens=32,
              max_prefill_tokens_per_step=64, cuda_graphs=True, prefill_graphs=True)
    off = drive(LocalV15Runner(model, attention=make_attention("triton", "cuda"), **kw), arrivals)
    cached = LocalV15Runner(model, attention=make_attention("triton", "cuda"), prefix_caching=True, **kw)
    cached.capture_ahead(120.0)
    on = drive(cached, arrivals)
    assert cached.scheduler.cached_tokens >= 4 * 40  # the later four found the voice's 5 blocks
    for i in off:
        np.testing.assert_array_equal(on[i], off[i], err_msg=str(i))
