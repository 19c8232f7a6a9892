"""Paged KV cache: blocks are taken on demand, returned on free, and slots map tokens to blocks."""

import pytest
import torch

from stages.runtime.kv_cache import KVCacheExhausted, KVCacheSpec, PagedKVCache


def make_cache(num_blocks=8, block_size=4) -> PagedKVCache:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=num_blocks, block_size=block_size)
    return PagedKVCache(spec, dtype=torch.float32, device="cpu")


def test_blocks_follow_usage_and_return_on_free():
    cache = make_cache()
    assert cache.num_used_blocks == 0
    cache.append_slots(7, 5)  # 5 tokens -> 2 blocks
    assert cache.num_used_blocks == 2 and cache.length(7) == 5
    cache.append_slots(7, 3)  # 8 tokens -> still 2 blocks
    assert cache.num_used_blocks == 2
    cache.append_slots(7, 1)  # 9 tokens -> 3 blocks
    cache.append_slots(9, 1)
    assert cache.num_used_blocks == 4
    cache.free(7)
    assert cache.num_used_blocks == 1 and cache.num_free_blocks == 7 and 7 not in cache
    cache.free(7)  # idempotent
    cache.free(9)
    assert cache.num_free_blocks == 8


def test_slots_address_the_block_table():
    cache = make_cache()
    cache.append_slots(1, 2)  # takes block 0
    start, slots = cache.append_slots(2, 6)  # blocks 1, 2
    assert start == 0 and cache.block_table(2) == [1, 2]
    assert slots == [4, 5, 6, 7, 8, 9]
    cache.free(1)
    start, slots = cache.append_slots(2, 3)  # token 6, 7 in block 2; token 8 in recycled block 0
    assert start == 6 and slots == [10, 11, 0]
    k = torch.arange(3 * 2 * 8, dtype=torch.float32).view(3, 2, 8)
    cache.write(1, torch.tensor(slots), k, -k)
    assert torch.equal(cache.keys[1][2, 2:], k[:2]) and torch.equal(cache.values[1][0, 0], -k[2])


def test_exhaustion_is_an_error_that_leaves_state_intact():
    cache = make_cache(num_blocks=2)
    cache.append_slots(1, 8)
    with pytest.raises(KVCacheExhausted):
        cache.append_slots(2, 1)
    assert cache.num_free_blocks == 0 and cache.length(2) == 0 and 2 not in cache
