"""Mixed steps (`mixed_step_tokens`): a step that decodes many requests and takes new prompt chunks
replays one graph for both, and every request gets exactly the frames it gets from the decode and
prefill graphs (and from one eager call) — the eager twin of the graphs, on CPU."""

import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from stages.models.local_v15.runner import MIXED_MIN_DECODE, LocalV15Runner
from stages.runtime.attention.backends import PaddedBatchAttention
from stages.runtime.mixed_graphs import MixedGraphs
from stages.runtime.prefill_graphs import PrefillChunk
from tests.stages.test_local_v15_runner import CASES, case

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def requests(golden, n):
    """n seeded requests over the golden prompts, several settings and lengths."""
    prompts = [case(golden, name)["input_ids"] for name in CASES]
    settings = [dict(), dict(temperature=1.0, top_k=5), dict(top_p=0.5, repetition_penalty=1.3), dict(top_k=1)]
    return {rid: (prompts[rid % 3][: len(prompts[rid % 3]) - (rid // 3) % 4 * 3],
                  SamplingParams(seed=500 + rid, forced_frames=6 + rid % 5, **settings[rid % 4]))
            for rid in range(n)}


def serve(runner, first, later, join_at=3):
    """`first` admitted at once; `later` admitted after `join_at` steps, while `first` decode.
    Returns each request's codes [frames, 12]."""
    frames = {rid: [] for rid in (*first, *later)}
    for rid, (prompt, params) in first.items():
        runner.add(rid, prompt, params)
    for step in range(300):
        if step == join_at:
            for rid, (prompt, params) in later.items():
                runner.add(rid, prompt, params)
        events = runner.step()
        for ev in events:
            if ev.codes is not None:
                frames[ev.rid].append(ev.codes)
        if step > join_at and runner.num_running() == 0 and not events:
            break  # (one step ahead, the last events come in the call after the last request left)
    assert runner.num_running() == 0
    return {rid: np.array(f, dtype=np.int64).reshape(-1, 12) for rid, f in frames.items()}


def make(model, graph_path, mixed, overlap_steps=False):
    """The first requests are prefilled in one step; the later ones' prompts fit one mixed step."""
    return LocalV15Runner(model, max_running=24, kv_block_size=8, num_kv_blocks=24 * 16, prefill_chunk_tokens=512,
                          max_prefill_tokens_per_step=2048, attention=PaddedBatchAttention(), graph_path=graph_path,
                          prefill_graphs=graph_path != "off", mixed_step_tokens=mixed, overlap_steps=overlap_steps)


def test_mixed_steps_give_every_request_its_own_frames(local_v15_model, local_v15_dir):
    reqs = requests(local_v15_dir, MIXED_MIN_DECODE + 3)
    first = {rid: reqs[rid] for rid in range(MIXED_MIN_DECODE)}
    later = {rid: reqs[rid] for rid in range(MIXED_MIN_DECODE, MIXED_MIN_DECODE + 3)}
    mixed = make(local_v15_model, "eager", 256)
    got = serve(mixed, first, later)
    # the newcomers' prompts went through mixed replays beside the decoding requests
    assert mixed._mixed_sets and any(g.keys for g in mixed._mixed_sets.values())
    want = serve(make(local_v15_model, "eager", 0), first, later)  # decode + prefill graphs
    one_call = serve(make(local_v15_model, "off", 0), first, later)
    for rid in reqs:
        assert len(got[rid]) == reqs[rid][1].forced_frames
        np.testing.assert_array_equal(got[rid], want[rid], err_msg=str(rid))
        np.testing.assert_array_equal(got[rid], one_call[rid], err_msg=str(rid))
    assert mixed.cache.num_used_blocks == 1  # only the padding rows' scratch block stays


def test_mixed_steps_one_step_ahead_give_the_same_frames(local_v15_model, local_v15_dir):
    """One step ahead (`overlap_steps`, as a server would measure it beside mixed steps): the
    newcomers join in mixed replays planned before the previous step's results are read, and
    every request gets the frames of the step-by-step runner."""
    reqs = requests(local_v15_dir, MIXED_MIN_DECODE + 3)
    first = {rid: reqs[rid] for rid in range(MIXED_MIN_DECODE)}
    later = {rid: reqs[rid] for rid in range(MIXED_MIN_DECODE, MIXED_MIN_DECODE + 3)}
    ahead = make(local_v15_model, "eager", 256, overlap_steps=True)
    mixed = []
    launch = ahead._mixed_part
    ahead._mixed_part = lambda *a: mixed.append(1) or launch(*a)
    got = serve(ahead, first, later)
    assert ahead.overlap_steps and mixed
    want = serve(make(local_v15_model, "eager", 256), first, later)
    for rid in reqs:
        assert len(got[rid]) == reqs[rid][1].forced_frames
        np.testing.assert_array_equal(got[rid], want[rid], err_msg=str(rid))
    assert ahead._pending is None and ahead.cache.num_used_blocks == 1


def test_small_decode_batches_keep_the_two_replays_and_no_graphs_means_off(local_v15_model, local_v15_dir):
    runner = make(local_v15_model, "eager", 16)
    decode = [object()] * (MIXED_MIN_DECODE - 1)
    assert not runner._mixes(decode, [(None, 4)])  # too few decoding requests
    assert not runner._mixes([], [(None, 4)])
    # the profile's setting reaches the runner; without a graph path (CPU serving) it is off
    from profiles import load_profile
    from stages.models.local_v15.runner import load_talker_runner

    assert load_talker_runner(local_v15_dir, load_profile("cpu", ["talker.mixed_step_tokens=64"]),
                              "cpu").mixed_step_tokens == 0
    assert make(local_v15_model, "off", 64).mixed_step_tokens == 0


def test_mixed_inputs_pack_padding_onto_the_scratch_slot_and_block():
    """The packed input of 2 decode rows and 2 chunks (one completing its prompt) in a (4, 16)
    bucket: decode rows first, chunk tokens after them, padding on the scratch slot and block."""
    seen = {}

    def body(x):
        seen.update(rows=x.rows.clone(), slots=x.slots.clone(), frames=x.frames.clone(),
                    valid=x.meta.prefill_valid.clone(), qstart=x.meta.query_start_loc.clone(),
                    kv=x.meta.slot_mapping.clone(), ids=x.ids.clone())
        return (x.slots.clone(),)

    g = MixedGraphs(body, lambda rows: (torch.empty(rows, dtype=torch.long),), width=3, max_batch=8, max_tokens=16,
                    max_seqs=3, table_width=4, scratch_slot=99, scratch_block=7, block_size=4,
                    device=torch.device("cpu"), capture=False)
    assert g.fits(2, [3, 2], [2, 1]) and not g.fits(2, [3, 2, 1, 1], [1]) and not g.fits(2, [20], [5])
    chunks = [PrefillChunk(np.full((3, 3), 5), 0, [40, 41, 42], [10]),
              PrefillChunk(np.full((2, 3), 6), 4, [52, 53], [12, 13])]
    (slots,) = g.run([3, 4], [9, 2], [17, 5], [70, 80], [[1, 2, 3], [4, 5]], chunks, [(11, 0), None])
    assert g.keys == [(2, 16)]
    B = 2
    assert seen["slots"].tolist() == [3, 4, 11, 99, 99] and seen["frames"].tolist() == [9, 2, 0, 0, 0]
    assert seen["rows"].tolist()[: B + 2] == [0, 1, B + 2, B + 4]  # each chunk's last token
    assert seen["qstart"].tolist() == [0, 1, 2, 5, 7, 7]  # the padding chunk holds no tokens
    assert seen["kv"].tolist()[:7] == [70, 80, 40, 41, 42, 52, 53] and set(seen["kv"].tolist()[7:]) == {28}
    assert seen["valid"].sum(1).tolist() == [3, 2, 0]
    assert (seen["ids"][:5] > 0).all() and (seen["ids"][5:] == 0).all()
    assert slots.shape == (B + 3,)  # the sampled rows: B decode rows, then one per chunk place


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_mixed_graphs_equal_the_two_replays():
    """On the GPU with the Triton attention (one table width): mixed steps recorded as CUDA graphs
    give every request the codes of the decode and prefill graphs (tiny model, fp32)."""
    from stages.models.local_v15.config import tiny_config
    from stages.models.local_v15.loader import build_talker_module
    from stages.runtime.attention.triton_paged import TritonPagedAttention

    torch.manual_seed(0)
    model = build_talker_module(tiny_config()).cuda().eval()
    rng = np.random.default_rng(1)
    reqs = {}
    for i in range(MIXED_MIN_DECODE + 3):
        p = np.full((20 + 5 * (i % 4), 13), 1024, np.int64)
        p[:, 0] = rng.integers(0, 600, len(p))
        reqs[i] = (p, SamplingParams(seed=i, top_k=5, forced_frames=8 + i % 5))
    first = {i: reqs[i] for i in range(MIXED_MIN_DECODE)}
    later = {i: reqs[i] for i in range(MIXED_MIN_DECODE, len(reqs))}

    def runner(mixed):
        return LocalV15Runner(model, max_running=24, kv_block_size=16, num_kv_blocks=24 * 8, prefill_chunk_tokens=512,
                              max_prefill_tokens_per_step=1024, attention=TritonPagedAttention(), cuda_graphs=True,
                              prefill_graphs=True, mixed_step_tokens=mixed)

    mixed = runner(128)
    got = serve(mixed, first, later)
    want = serve(runner(0), first, later)
    made = [g for graphs in mixed._mixed_sets.values() for g in graphs._graphs.values()]
    assert made and all(g.call.graph is not None for g in made)  # recorded, replayed
    for i in reqs:
        np.testing.assert_array_equal(got[i], want[i], err_msg=str(i))


def test_graphs_made_counts_every_bucket_recorded_and_a_repeat_records_none(local_v15_model, local_v15_dir):
    """`graphs_made`: the talker worker's sign that a step recorded a graph (a stall for every
    stream): it grows while new buckets are met, not when the same traffic comes again."""
    reqs = requests(local_v15_dir, MIXED_MIN_DECODE + 3)
    first = {rid: reqs[rid] for rid in range(MIXED_MIN_DECODE)}
    later = {rid: reqs[rid] for rid in range(MIXED_MIN_DECODE, MIXED_MIN_DECODE + 3)}
    runner = make(local_v15_model, "eager", 256)
    assert runner.graphs_made() == 0
    serve(runner, first, later)
    made = runner.graphs_made()
    kinds = {type(g).__name__: len(g.keys) for g in runner.graph_sets()}
    assert made == sum(kinds.values()) and all(kinds.values())
    assert {"DecodeGraphs", "FrameGraphs", "MixedGraphs", "PrefillGraphs"} <= set(kinds)
    serve(runner, {rid + 100: r for rid, r in first.items()}, {rid + 100: r for rid, r in later.items()})
    assert runner.graphs_made() == made
