"""Triton paged attention equals ReferenceAttention.

With a CUDA device the compiled kernels run on it. Without one, the tests run on CPU tensors through
Triton's interpreter: TRITON_INTERPRET=1 has to be set before triton itself is imported (triton's
own library functions are decorated then), so this module sets it first thing when there is no
CUDA device; with no GPU nothing else in the process could run compiled Triton kernels anyway.
Small shapes only: the interpreter executes every program in numpy.
"""

import torch

from tests import triton_cpu  # noqa: E402, F401  (before triton: its CPU interpreter)

import dataclasses  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from stages.runtime.attention.backends import PaddedBatchAttention, ReferenceAttention, make_attention  # noqa: E402
from stages.runtime.attention.metadata import AttentionMetadata, build_attention_metadata  # noqa: E402
from stages.runtime.attention.triton_paged import TritonPagedAttention  # noqa: E402
from stages.runtime.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HKV, BS = 4, 2, 4
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def make_cache(dtype, head_dim, num_blocks=64, seed=0):
    torch.manual_seed(seed)
    cache = PagedKVCache(KVCacheSpec(1, HKV, head_dim, num_blocks, BS), dtype=dtype, device=DEVICE)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape))  # every slot holds data; only valid ones may count
    cache.values[0].copy_(torch.randn(cache.values[0].shape))
    return cache


def fill_contexts(cache, contexts: dict[int, int]) -> None:
    """Grow the sequences round-robin by a few tokens so their block tables interleave."""
    left = dict(contexts)
    while any(left.values()):
        for s, n in left.items():
            if n:
                take = min(n, 3)
                cache.append_slots(s, take)
                left[s] -= take


def check(backend, cache, batch, dtype, head_dim, seed=1):
    meta = build_attention_metadata(cache, batch, DEVICE)
    torch.manual_seed(seed)
    q = torch.randn(meta.num_tokens, HQ, head_dim).to(DEVICE, dtype)
    want = ReferenceAttention()(q, cache.keys[0], cache.values[0], meta, head_dim**-0.5)
    got = backend(q, cache.keys[0], cache.values[0], meta, head_dim**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    return meta, q, got


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_only_equals_reference(dtype, num_splits):
    contexts = {0: 0, 1: 6, 2: 39, 3: 15, 4: 16}  # seq 0: its first token; 4: ends on a block edge
    cache = make_cache(dtype, 32)
    fill_contexts(cache, contexts)
    backend = TritonPagedAttention(block_n=16, num_splits=num_splits)
    check(backend, cache, [(s, 1) for s in (3, 0, 4, 1, 2)], dtype, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_m", [4, 16])
def test_mixed_prefill_and_decode_equals_reference(dtype, block_m):
    contexts = {0: 20, 1: 7, 2: 0, 3: 33}
    cache = make_cache(dtype, 16)
    fill_contexts(cache, contexts)
    backend = TritonPagedAttention(block_n=16, block_m=block_m, num_splits=2)
    # a fresh prompt (2), chunked prefills after context (0, 3), decodes (1, 4 new with one token)
    batch = [(1, 1), (2, 13), (0, 9), (4, 1), (3, 2)]
    check(backend, cache, batch, dtype, 16)
    # the next step: everyone decodes
    check(backend, cache, [(s, 1) for s in range(5)], dtype, 16, seed=2)


def test_prefill_only_single_token_prompts_and_splits_pick_from_shapes():
    cache = make_cache(torch.float32, 16)
    backend = TritonPagedAttention(block_n=16)
    check(backend, cache, [(0, 21), (1, 1), (2, 5)], torch.float32, 16)
    assert backend.decode_splits(1, 8, 4096) == 32  # B=1, long context: split-K (8 * 32 programs)
    assert backend.decode_splits(128, 8, 4096) == 1  # a full batch already fills the GPU
    assert backend.decode_splits(1, 8, 64) == 1  # short context: one split


def graph_style_meta(cache, seqs: list[int], batch: int, width: int, scratch_block: int) -> AttentionMetadata:
    """Decode metadata as stages/models/local_v15/graphs.py builds it: `batch` rows (padding rows point at
    the scratch block with seq_len 1), tables padded to `width` with the scratch block, seq_lens
    and tables as strided views of one packed int64 tensor, host lengths as upper bounds."""
    packed = torch.full((batch, 1 + width), scratch_block, dtype=torch.int64)
    packed[:, 0] = 1
    slots = []
    for i, s in enumerate(seqs):
        start, new = cache.append_slots(s, 1)
        slots += new
        table = cache.block_table(s)
        packed[i, 0] = start + 1
        packed[i, 1 : 1 + len(table)] = torch.tensor(table)
    slots += [scratch_block * BS] * (batch - len(seqs))
    packed = packed.to(DEVICE)
    arange = torch.arange(batch, device=DEVICE)
    return AttentionMetadata(
        seq_ids=tuple(range(batch)), query_start_loc=torch.arange(batch + 1, device=DEVICE, dtype=torch.int32),
        seq_lens=packed[:, 0], context_lens=packed[:, 0] - 1, block_tables=packed[:, 1:],
        slot_mapping=torch.tensor(slots, device=DEVICE), positions=packed[:, 0] - 1, last_token_index=arange,
        decode_rows=arange, decode_seqs=arange, prefill_seqs=arange[:0], prefill_rows=arange[:0, None],
        prefill_valid=torch.zeros(0, 1, dtype=torch.bool, device=DEVICE), query_lens_host=(1,) * batch,
        seq_lens_host=(width * BS,) * batch, max_query_len=1, max_seq_len=width * BS,
    )


@pytest.mark.parametrize("num_splits", [1, 2])
def test_graph_style_padded_rows_and_tables(num_splits):
    dtype, head_dim = torch.bfloat16, 16
    cache = make_cache(dtype, head_dim)
    scratch = cache.spec.num_blocks - 1
    contexts = {0: 12, 1: 30, 2: 3}
    fill_contexts(cache, contexts)
    meta = graph_style_meta(cache, [0, 1, 2], batch=8, width=12, scratch_block=scratch)
    torch.manual_seed(3)
    q = torch.randn(8, HQ, head_dim).to(DEVICE, dtype)
    got = TritonPagedAttention(block_n=16, num_splits=num_splits)(q, cache.keys[0], cache.values[0], meta,
                                                                  head_dim**-0.5)
    # the reference reads host lengths: give it the real ones (padding rows: one key in the scratch block)
    real = dataclasses.replace(meta, seq_lens_host=tuple(meta.seq_lens.tolist()),
                               max_seq_len=int(meta.seq_lens.max()))
    want = ReferenceAttention()(q, cache.keys[0], cache.values[0], real, head_dim**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.isfinite(got.float()).all()


def test_make_attention(monkeypatch):
    assert isinstance(make_attention("padded", "cpu"), PaddedBatchAttention)
    assert isinstance(make_attention("auto", "cpu"), PaddedBatchAttention)
    if torch.cuda.is_available():
        assert isinstance(make_attention("auto", "cuda"), TritonPagedAttention)
        assert isinstance(make_attention("triton", "cuda:0"), TritonPagedAttention)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA"):
        make_attention("triton", "cpu")
    with pytest.raises(ValueError, match="unknown"):
        make_attention("flash", "cpu")


@torch.no_grad()
def test_qwen3_paged_forward_with_triton_equals_reference():
    from stages.models.qwen3 import Qwen3Config, Qwen3Model

    cfg = Qwen3Config(hidden_size=64, num_layers=2, num_heads=HQ, num_kv_heads=HKV, head_dim=16,
                      intermediate_size=128, vocab_size=97, rope_theta=1e4)
    torch.manual_seed(0)
    model = Qwen3Model(cfg).eval().to(DEVICE)
    prompts = {s: torch.randn(n, cfg.hidden_size, device=DEVICE) for s, n in {0: 9, 1: 23, 2: 4}.items()}
    outs = {}
    for name, backend in (("ref", ReferenceAttention()), ("triton", TritonPagedAttention(block_n=16, num_splits=2))):
        cache = PagedKVCache(cfg.kv_cache_spec(num_blocks=32, block_size=BS), dtype=torch.float32, device=DEVICE)
        torch.manual_seed(5)
        meta = build_attention_metadata(cache, [(0, 9), (1, 23)], DEVICE)
        steps = [model(torch.cat([prompts[0], prompts[1]]), meta, cache, backend)]
        for step in range(2):  # decodes of 0 and 1 next to seq 2's prompt, then decodes only
            batch = [(0, 1), (1, 1)] + ([(2, 4)] if step == 0 else [(2, 1)])
            x = torch.randn(2, cfg.hidden_size, device=DEVICE)
            x = torch.cat([x, prompts[2] if step == 0 else torch.randn(1, cfg.hidden_size, device=DEVICE)])
            steps.append(model(x, build_attention_metadata(cache, batch, DEVICE), cache, backend))
        outs[name] = steps
    for ref, got in zip(outs["ref"], outs["triton"]):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_batch_invariant_backend_gives_a_token_the_same_bits_decoded_or_prefilled():
    """With one split and decode rows run as prefill tiles, the attention of sequence 0's token at
    position 20 is bit-identical decoded alone, decoded among others, and as the last token of a
    prompt chunk next to other chunks (its keys and values are the same in every case)."""
    backend = TritonPagedAttention(block_n=16, num_splits=1, decode_as_prefill=True)
    assert backend.batch_invariant and not TritonPagedAttention().batch_invariant
    D, target = 16, torch.randn(HQ, 16, generator=torch.Generator().manual_seed(9))

    def attend(contexts: dict[int, int], batch: list[tuple[int, int]]) -> torch.Tensor:
        cache = make_cache(torch.float32, D, seed=3)
        fill_contexts(cache, contexts)
        meta = build_attention_metadata(cache, batch, DEVICE)
        for s, _ in batch:  # K/V of (sequence, position) the same whichever block holds it
            for p in range(cache.length(s)):
                block, row = cache.block_table(s)[p // BS], p % BS
                g = torch.Generator().manual_seed(1000 * s + p)
                cache.keys[0][block, row] = torch.randn(HKV, D, generator=g).to(DEVICE)
                cache.values[0][block, row] = torch.randn(HKV, D, generator=g).to(DEVICE)
        q = torch.randn(meta.num_tokens, HQ, D).to(DEVICE)
        row = meta.seq_ids.index(0)
        last = int(meta.query_start_loc[row + 1]) - 1
        q[last] = target.to(DEVICE)
        return backend(q, cache.keys[0], cache.values[0], meta, D**-0.5)[last]

    alone = attend({0: 20}, [(0, 1)])
    assert torch.equal(alone, attend({0: 20, 1: 5, 2: 33, 3: 2}, [(1, 1), (2, 1), (0, 1), (3, 1)]))
    assert torch.equal(alone, attend({0: 17, 1: 9, 2: 0}, [(1, 1), (0, 4), (2, 7)]))
    assert torch.equal(alone, attend({0: 3, 1: 4}, [(0, 18), (1, 1)]))


def test_warm_variants_launch_every_split_count_and_prefill():
    """Seven decode split counts (1 to 64) and a prefill launch on a tiny cache of the served
    layout; one split count when it is fixed; the prefill launch alone for the batch-invariant
    backend (its decode rows run as prefill); no variants for a backend without them."""
    spec = KVCacheSpec(2, HKV, 16, 64, BS)
    assert TritonPagedAttention().warm_variants(spec, torch.float32, HQ, DEVICE) == 8
    assert TritonPagedAttention(num_splits=4).warm_variants(spec, torch.float32, HQ, DEVICE) == 2
    assert TritonPagedAttention(decode_as_prefill=True).warm_variants(spec, torch.float32, HQ, DEVICE) == 1
    assert TritonPagedAttention().split_counts() == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_after_warm_variants_eager_batches_specialise_no_kernel():
    """Decode batches of several sizes over several context lengths (each picking its split count
    from the shapes) and a prefill beside decode rows, after `warm_variants`: Triton compiles
    nothing new (a variant met first while serving stalls a step for hundreds of ms)."""
    from stages.workers.common import triton_kernel_counter

    dtype, head_dim = torch.bfloat16, 64
    attention = TritonPagedAttention()
    count = triton_kernel_counter("cuda")
    cache = make_cache(dtype, head_dim, num_blocks=5000)  # room for every context below (~15.5k tokens)
    attention.warm_variants(cache.spec, dtype, HQ, DEVICE)
    made = count()
    seq = 0
    for n_dec, context in ((1, 5), (3, 40), (5, 300), (9, 120), (17, 600), (40, 64)):
        ids = list(range(seq, seq + n_dec))
        seq += n_dec
        fill_contexts(cache, dict.fromkeys(ids, context))
        batch = [(s, 1) for s in ids] + ([(seq, 7)] if n_dec == 9 else [])
        seq += n_dec == 9
        meta = build_attention_metadata(cache, batch, DEVICE)
        q = torch.randn(sum(n for _, n in batch), HQ, head_dim, dtype=dtype, device=DEVICE)
        attention(q, cache.keys[0], cache.values[0], meta, head_dim ** -0.5)
    torch.cuda.synchronize()
    assert count() == made, count.since(made)


def test_a_runner_warms_the_variants_of_its_attention(local_v15_model):
    """The talker worker's warm-up calls `warm_attention`: the Triton backend's variants, in the
    runner's KV layout and dtype; nothing for a backend without variants."""
    from stages.models.local_v15.runner import LocalV15Runner

    runner = LocalV15Runner(local_v15_model, max_running=2, num_kv_blocks=16, attention=TritonPagedAttention())
    assert runner.warm_attention() == 8
    assert LocalV15Runner(local_v15_model, max_running=2, num_kv_blocks=16).warm_attention() == 0


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_float8_cache_is_read_as_the_reference_reads_it(num_splits):
    """`talker.kv_cache_dtype: fp8`: bf16 queries over a float8 e4m3 cache, decode rows and a
    prefill chunk, the kernel upcasting each tile as it loads it: the reference's result over the
    same stored values."""
    cache = PagedKVCache(KVCacheSpec(1, HKV, 32, 64, BS), dtype=torch.float8_e4m3fn, device=DEVICE)
    torch.manual_seed(0)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape))
    cache.values[0].copy_(torch.randn(cache.values[0].shape))
    fill_contexts(cache, {0: 9, 1: 30, 2: 17})
    check(TritonPagedAttention(block_n=16, num_splits=num_splits), cache, [(0, 1), (1, 1), (2, 5)],
          torch.bfloat16, 32)


def test_keys_per_tile_follow_the_cache_element_size_unless_set():
    """With no `block_n`, a tile holds the same bytes whatever the cache: 64 keys of bf16, 128 of
    float8, 32 of float32; a set `block_n` is kept. A float8 cache read 128 keys a tile (more than
    a sequence's length here, and past a block table's end) gives the reference's result."""
    auto = TritonPagedAttention()
    assert [auto.keys_per_tile(d) for d in (torch.bfloat16, torch.float8_e4m3fn, torch.float32)] == [64, 128, 32]
    assert TritonPagedAttention(block_n=16).keys_per_tile(torch.float8_e4m3fn) == 16
    cache = PagedKVCache(KVCacheSpec(1, HKV, 32, 96, BS), dtype=torch.float8_e4m3fn, device=DEVICE)
    torch.manual_seed(0)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape))
    cache.values[0].copy_(torch.randn(cache.values[0].shape))
    fill_contexts(cache, {0: 150, 1: 30})
    check(TritonPagedAttention(num_splits=1, num_stages=2), cache, [(0, 1), (1, 1)], torch.bfloat16, 32)


def test_pipeline_stages_follow_the_cache_element_size_unless_set():
    """With no `num_stages`, a float8 cache's key loop runs 2 stages (measured faster) and wider
    caches keep Triton's default; a set `num_stages` is kept for every cache."""
    auto = TritonPagedAttention()
    assert [auto.stages_per_loop(d) for d in (torch.float8_e4m3fn, torch.float8_e5m2)] == [2, 2]
    assert [auto.stages_per_loop(d) for d in (torch.bfloat16, torch.float32)] == [None, None]
    assert TritonPagedAttention(num_stages=3).stages_per_loop(torch.float8_e4m3fn) == 3


def test_the_output_is_cleared_only_where_some_row_attends_nothing(monkeypatch):
    """Every row of an eager step's q is a sequence's token (`every_row_attends`), so the kernels
    write the whole output and no fill kernel runs first (one launch a layer fewer); metadata
    without that promise (the prefill and mixed graphs', whose padding rows no sequence covers)
    gets its output cleared, and the result is the same."""
    cache = make_cache(torch.float32, 16)
    fill_contexts(cache, {0: 9, 1: 5, 2: 13})
    batch = [(0, 1), (1, 3), (2, 1)]
    meta, q, want = check(TritonPagedAttention(), cache, batch, torch.float32, 16)
    fills = []
    zeros_like = torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda *a, **k: fills.append(1) or zeros_like(*a, **k))
    assert meta.every_row_attends
    got = TritonPagedAttention()(q, cache.keys[0], cache.values[0], meta, 16**-0.5)
    assert not fills
    padded = dataclasses.replace(meta, every_row_attends=False)
    again = TritonPagedAttention()(q, cache.keys[0], cache.values[0], padded, 16**-0.5)
    assert len(fills) == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_a_decode_graphs_padding_rows_attend_the_scratch_block():
    """The packed inputs of a decode graph give every row, padding included, a sequence (the
    scratch block): its metadata promises every row attends."""
    from stages.runtime.graph_capture import decode_metadata, pack_decode_inputs

    packed = pack_decode_inputs([0, 1], [3, 4], [5, 6], [21, 34], [6, 7], [[5, 1], [8]], batch=4, blocks=2,
                                scratch_slot=9, scratch_block=15, block_size=BS)
    meta = decode_metadata(packed, BS)
    assert meta.every_row_attends and meta.decode_seqs.tolist() == [0, 1, 2, 3]
