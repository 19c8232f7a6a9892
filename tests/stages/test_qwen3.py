"""Qwen3 backbone: the paged, packed serving path equals whole-sequence forwards; HF agrees."""

import pytest
import torch

from stages.models.qwen3 import Qwen3Config, Qwen3Model
from stages.runtime.attention.metadata import build_attention_metadata
from stages.runtime.kv_cache import PagedKVCache

CFG = Qwen3Config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=97, rope_theta=1e4)


def make_model(seed: int = 0) -> Qwen3Model:
    torch.manual_seed(seed)
    model = Qwen3Model(CFG).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm gains deliberately away from 1
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    return model


@torch.no_grad()
def test_paged_mixed_batches_equal_dense_forward():
    model = make_model()
    lengths = {0: 37, 1: 5, 2: 20, 3: 51}
    embeds = {s: torch.randn(n, CFG.hidden_size) for s, n in lengths.items()}
    expected = {s: model.forward_dense(e[None])[0] for s, e in embeds.items()}

    cache = PagedKVCache(CFG.kv_cache_spec(num_blocks=40, block_size=4), dtype=torch.float32, device="cpu")
    got = {s: [] for s in lengths}
    done = dict.fromkeys(lengths, 0)
    # schedule: seq 1 prefills whole and then decodes token by token; the others prefill in
    # chunks of up to 9 tokens next to those decodes; seq 3 joins late.
    chunk = {0: 9, 1: 5, 2: 7, 3: 9}
    step = 0
    while any(done[s] < n for s, n in lengths.items()):
        batch = []
        for s, n in lengths.items():
            if done[s] >= n or (s == 3 and step < 3):
                continue
            take = 1 if (s == 1 and done[s] >= 5) else chunk[s]
            batch.append((s, min(take, n - done[s])))
        meta = build_attention_metadata(cache, batch, "cpu")
        x = torch.cat([embeds[s][done[s] : done[s] + n] for s, n in batch])
        out = model(x, meta, cache)
        row = 0
        for s, n in batch:
            got[s].append(out[row : row + n])
            row += n
            done[s] += n
        step += 1
    for s in lengths:
        torch.testing.assert_close(torch.cat(got[s]), expected[s], atol=1e-5, rtol=1e-5)
    assert cache.num_used_blocks == sum(-(-n // 4) for n in lengths.values())


@torch.no_grad()
def test_dense_left_padding_matches_unpadded():
    model = make_model(1)
    e = torch.randn(1, 12, CFG.hidden_size)
    padded = torch.cat([torch.zeros(1, 3, CFG.hidden_size), e], dim=1)
    mask = torch.tensor([[False] * 3 + [True] * 12])
    out = model.forward_dense(padded, mask)
    assert torch.isfinite(out).all()
    assert out[0, :3].abs().max() == 0
    torch.testing.assert_close(out[:, 3:], model.forward_dense(e), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_matches_transformers_qwen3():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.Qwen3Config(
        hidden_size=CFG.hidden_size, num_hidden_layers=CFG.num_layers, num_attention_heads=CFG.num_heads,
        num_key_value_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, intermediate_size=CFG.intermediate_size,
        vocab_size=CFG.vocab_size, rms_norm_eps=CFG.rms_norm_eps, rope_theta=CFG.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": CFG.rope_theta}, attention_bias=False,
    )
    hf = transformers.Qwen3Model(hf_cfg).eval()
    model = make_model(2)
    result = hf.load_state_dict(model.state_dict(), strict=False)
    assert not result.unexpected_keys and all("rotary" in k for k in result.missing_keys)
    assert Qwen3Config.from_hf(hf_cfg.to_dict()) == CFG
    ids = torch.randint(0, CFG.vocab_size, (2, 17))
    ref = hf(input_ids=ids).last_hidden_state
    ours = model.forward_dense(model.embed_tokens(ids))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_batched_decode_backend_agrees_with_reference():
    from stages.runtime.attention.backends import PaddedBatchAttention

    model = make_model(3)
    prompts = {s: torch.randn(n, CFG.hidden_size) for s, n in {0: 9, 1: 23, 2: 4, 3: 30}.items()}
    outs = {}
    for name, backend in (("ref", None), ("batched", PaddedBatchAttention())):
        cache = PagedKVCache(CFG.kv_cache_spec(num_blocks=32, block_size=4), dtype=torch.float32, device="cpu")
        torch.manual_seed(5)
        steps = []
        # step 0: prefill 0..2; then 3 decode steps with seq 3 prefilling in two chunks alongside
        meta = build_attention_metadata(cache, [(0, 9), (1, 23), (2, 4)], "cpu")
        steps.append(model(torch.cat([prompts[s] for s in (0, 1, 2)]), meta, cache, backend))
        for step in range(3):
            batch = [(0, 1), (1, 1), (2, 1)] + ([(3, 15)] if step < 2 else [])
            x = torch.randn(3, CFG.hidden_size)
            if step < 2:
                x = torch.cat([x, prompts[3][15 * step : 15 * step + 15]])
            meta = build_attention_metadata(cache, batch, "cpu")
            steps.append(model(x, meta, cache, backend))
        outs[name] = steps
    for ref, got in zip(outs["ref"], outs["batched"]):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
