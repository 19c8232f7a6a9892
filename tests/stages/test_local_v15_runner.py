"""The Local-v1.5 runner: continuous batching over the paged KV cache gives each request exactly
what it would get alone (greedy = upstream golden codes; seeded sampling = the same codes alone or
in a batch), forced/length finishes, KV blocks returned, preemption by recompute is exact."""

import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from stages.models.local_v15.runner import LocalV15Runner
from stages.runtime.attention.backends import PaddedBatchAttention, ReferenceAttention

CASES = ("plain", "voice_clone", "continuation")


def case(golden, name):
    with np.load(golden / f"case_{name}.npz") as z:
        return {k: z[k] for k in z.files}


def run(runner, requests, max_steps=500):
    """Add all requests (rid -> (prompt, params)) as capacity allows; collect frames and finishes."""
    pending = list(requests.items())
    frames = {rid: [] for rid in requests}
    finish = {}
    for _ in range(max_steps):
        while pending and runner.can_admit(len(pending[0][1][0])):
            rid, (prompt, params) = pending.pop(0)
            runner.add(rid, prompt, params)
        if not pending and runner.num_running() == 0:
            break
        for ev in runner.step():
            assert ev.rid not in finish
            if ev.codes is not None:
                frames[ev.rid].append(ev.codes)
            if ev.finished:
                finish[ev.rid] = ev.reason
    assert not pending and runner.num_running() == 0
    return {rid: np.array(f, dtype=np.int64).reshape(-1, 12) for rid, f in frames.items()}, finish


@pytest.mark.parametrize("backend, graph_path", [(ReferenceAttention, "off"), (PaddedBatchAttention, "off"),
                                                 (PaddedBatchAttention, "eager")])
def test_batched_greedy_equals_upstream_golden(local_v15_model, local_v15_dir, backend, graph_path):
    runner = LocalV15Runner(local_v15_model, max_running=4, kv_block_size=8, num_kv_blocks=64, prefill_chunk_tokens=24,
                            max_prefill_tokens_per_step=40, attention=backend(), graph_path=graph_path)
    greedy = SamplingParams(greedy=True, max_new_frames=16)
    cases = {i: case(local_v15_dir, name) for i, name in enumerate(CASES)}
    frames, finish = run(runner, {i: (c["input_ids"], greedy) for i, c in cases.items()})
    for i, c in cases.items():
        np.testing.assert_array_equal(frames[i], c["generated_audio_codes"], err_msg=CASES[i])
        assert finish[i] == ("stop" if c["stopped"] else "length")
    assert runner.cache.num_used_blocks == (graph_path != "off")  # the graph path's scratch block stays


def mixed_requests(golden):
    """8 requests: different seeds, sampling settings, prompts and prompt lengths."""
    prompts = [case(golden, n)["input_ids"] for n in CASES]
    settings = [dict(), dict(temperature=1.0, top_k=5), dict(top_p=0.5, repetition_penalty=1.3),
                dict(temperature=0.8, top_k=0, top_p=0.95), dict(repetition_penalty=1.1), dict(top_k=1),
                dict(text_temperature=1.5), dict(temperature=2.0, top_p=1.0)]
    reqs = {}
    for i, s in enumerate(settings):
        prompt = prompts[i % 3][: len(prompts[i % 3]) - (i // 3) * 7]  # several lengths
        forced = 5 + i if i % 2 == 0 else None  # the odd ones let the sampled stop head decide
        reqs[100 + i] = (prompt, SamplingParams(seed=1000 + 7 * i, max_new_frames=6 + i, forced_frames=forced, **s))
    return reqs


def test_seeded_sampling_is_batch_invariant(local_v15_model, local_v15_dir):
    reqs = mixed_requests(local_v15_dir)
    together, finish_t = run(LocalV15Runner(local_v15_model, max_running=8, num_kv_blocks=128, prefill_chunk_tokens=32,
                                            max_prefill_tokens_per_step=100), reqs)
    non_empty = [tuple(f.ravel()) for f in together.values() if len(f)]
    assert len(non_empty) >= 4 and len(set(non_empty)) == len(non_empty)  # every request has its own codes
    for rid, req in reqs.items():
        alone, finish_a = run(LocalV15Runner(local_v15_model, max_running=1, num_kv_blocks=32), {rid: req})
        np.testing.assert_array_equal(alone[rid], together[rid], err_msg=str(rid))
        assert finish_a[rid] == finish_t[rid]
    # a different seed changes the codes
    prompt, params = reqs[100]
    other, _ = run(LocalV15Runner(local_v15_model, max_running=1, num_kv_blocks=32),
                   {1: (prompt, SamplingParams(seed=params.seed + 1, max_new_frames=params.max_new_frames))})
    assert not np.array_equal(other[1], together[100])


def test_forced_frames_and_length_limit(local_v15_model, local_v15_dir):
    prompt = case(local_v15_dir, "plain")["input_ids"]  # greedy would stop after 15 frames
    runner = LocalV15Runner(local_v15_model, max_running=4, num_kv_blocks=64)
    frames, finish = run(runner, {
        1: (prompt, SamplingParams(greedy=True, forced_frames=20, max_new_frames=100)),
        2: (prompt, SamplingParams(greedy=True, forced_frames=3)),
        3: (prompt, SamplingParams(greedy=True, max_new_frames=4)),
        4: (prompt, SamplingParams(greedy=True, forced_frames=0)),
    })
    assert (len(frames[1]), finish[1]) == (20, "stop")
    np.testing.assert_array_equal(frames[1][:15], case(local_v15_dir, "plain")["generated_audio_codes"])
    assert (len(frames[2]), finish[2]) == (3, "stop")
    assert (len(frames[3]), finish[3]) == (4, "length")
    assert (len(frames[4]), finish[4]) == (0, "stop")


def test_kv_blocks_follow_requests_and_return_on_remove(local_v15_model, local_v15_dir):
    prompt = case(local_v15_dir, "voice_clone")["input_ids"]  # 75 rows
    runner = LocalV15Runner(local_v15_model, max_running=2, kv_block_size=16, num_kv_blocks=12,
                            prefill_chunk_tokens=40, max_prefill_tokens_per_step=40)
    runner.add(1, prompt, SamplingParams(seed=1))
    assert runner.cache.num_used_blocks == 0  # nothing until it runs
    assert runner.step() == []  # first chunk of 40 rows
    assert runner.cache.num_used_blocks == 3
    (ev,) = runner.step()  # rest of the prompt + first frame
    assert ev.rid == 1 and ev.codes is not None and runner.cache.num_used_blocks == 5
    assert runner.can_admit(75) and not runner.can_admit(16 * 8)
    runner.add(2, prompt, SamplingParams(seed=2))
    assert not runner.can_admit(75)  # slots full
    runner.remove(1)
    assert runner.cache.num_used_blocks == 0 and runner.num_running() == 1
    runner.remove(1)  # idempotent
    runner.remove(2)
    assert runner.num_running() == 0 and runner.cache.num_free_blocks == 12


def test_preemption_by_recompute_is_exact(local_v15_model, local_v15_dir):
    reqs = {i: (case(local_v15_dir, n)["input_ids"], SamplingParams(seed=i, forced_frames=40))
            for i, n in enumerate(CASES)}
    roomy, _ = run(LocalV15Runner(local_v15_model, max_running=3, kv_block_size=8, num_kv_blocks=64), reqs)
    # 3 requests of ~75 + 40 rows need ~45 blocks of 8; with 36 some must be preempted and resumed
    tight_runner = LocalV15Runner(local_v15_model, max_running=3, kv_block_size=8, num_kv_blocks=36)
    tight, _ = run(tight_runner, reqs)
    assert tight_runner.preemptions > 0
    for i in reqs:
        np.testing.assert_array_equal(tight[i], roomy[i])


def test_rejects_bad_requests(local_v15_model, local_v15_dir):
    runner = LocalV15Runner(local_v15_model, max_running=1, num_kv_blocks=4, kv_block_size=4)
    with pytest.raises(ValueError, match="prompt shape"):
        runner.add(1, np.zeros((5, 3), dtype=np.int64), SamplingParams())
    with pytest.raises(ValueError, match="exceeds the whole KV cache"):
        runner.add(1, case(local_v15_dir, "plain")["input_ids"], SamplingParams())
    assert runner.num_running() == 0


def test_runner_from_profile(local_v15_dir):
    from profiles.loader import load_profile
    from stages.models.local_v15.runner import load_talker_runner

    profile = load_profile("cpu")
    runner = load_talker_runner(local_v15_dir, profile, "cpu")
    assert runner.max_running == profile.talker.max_running
    assert runner.cache.spec.num_blocks == profile.talker.kv_blocks
    assert runner.cache.spec.block_size == profile.talker.kv_block_size
    assert runner.prefill_chunk_tokens == profile.talker.prefill_chunk_tokens
    assert runner.scheduler.prefill_interval == profile.talker.prefill_interval
    assert runner.dtype == torch.float32 and (runner.n_vq, runner.frame_rate) == (12, 12.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_equals_eager_decode():
    """Decode steps replayed from per-bucket CUDA graphs give the eager step's codes (tiny, fp32),
    also in steps that prefill next to them, with prefill_interval 3, and with the prefill chunks
    replayed from prefill graphs captured ahead."""
    from stages.models.local_v15.config import tiny_config
    from stages.models.local_v15.loader import build_talker_module

    torch.manual_seed(0)
    model = build_talker_module(tiny_config()).cuda().eval()
    rng = np.random.default_rng(0)
    reqs = {}
    for i in range(5):
        p = np.full((20 + 9 * i, 13), 1024, np.int64)
        p[:, 0] = rng.integers(0, 600, len(p))
        reqs[i] = (p, SamplingParams(seed=i, greedy=i == 0, forced_frames=10 + 3 * i))
    # small prefill chunks: some requests prefill while others already decode (mixed steps)
    capacity = dict(max_running=8, num_kv_blocks=64, kv_block_size=8, prefill_chunk_tokens=16,
                    max_prefill_tokens_per_step=32)
    eager, _ = run(LocalV15Runner(model, **capacity), reqs)
    runner = LocalV15Runner(model, **capacity, cuda_graphs=True)
    graphed, finish = run(runner, reqs)
    assert runner.graphs is not None and len(runner.graphs._graphs) >= 2  # several buckets were used
    assert len(runner.frame_graphs._graphs) >= 1  # mixed steps replayed the local loop
    spaced, _ = run(LocalV15Runner(model, **capacity, cuda_graphs=True, prefill_interval=3), reqs)
    prefilled = LocalV15Runner(model, **capacity, cuda_graphs=True, prefill_graphs=True)
    made = prefilled.capture_ahead(120.0)
    with_prefill, _ = run(prefilled, reqs)
    assert made >= 2 and all(g.call.graph is not None for g in prefilled.prefill_graphs._graphs.values())
    for i in reqs:
        np.testing.assert_array_equal(graphed[i], eager[i])
        np.testing.assert_array_equal(spaced[i], eager[i])
        np.testing.assert_array_equal(with_prefill[i], eager[i])
        assert finish[i] == "stop"


def test_decode_graph_inputs_are_packed_with_scratch_padding():
    from stages.runtime.graph_capture import bucket, pack_decode_inputs

    assert [bucket(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8] and bucket(3, 3) == 3
    packed = pack_decode_inputs([4, 1], [7, 0], [33, 8], [66, 17], [34, 9], [[3, 9, 8], [2]], batch=4, blocks=4,
                                scratch_slot=6, scratch_block=5, block_size=16).numpy()
    np.testing.assert_array_equal(packed, [
        [4, 7, 33, 66, 34, 3, 9, 8, 5],
        [1, 0, 8, 17, 9, 2, 5, 5, 5],
        [6, 0, 0, 80, 1, 5, 5, 5, 5],
        [6, 0, 0, 80, 1, 5, 5, 5, 5],
    ])


def test_abort_mid_prefill_and_reuse_of_the_id(local_v15_model, local_v15_dir):
    prompt = case(local_v15_dir, "plain")["input_ids"]
    runner = LocalV15Runner(local_v15_model, max_running=2, kv_block_size=8, num_kv_blocks=32,
                            prefill_chunk_tokens=16, max_prefill_tokens_per_step=16)
    runner.add(7, prompt, SamplingParams(greedy=True, max_new_frames=3))
    assert runner.step() == [] and runner.cache.num_used_blocks == 2  # 16 of 68 rows prefilled
    runner.remove(7)
    assert runner.cache.num_used_blocks == 0 and runner.num_running() == 0 and runner.step() == []
    frames, finish = run(runner, {7: (prompt, SamplingParams(greedy=True, max_new_frames=3))})
    np.testing.assert_array_equal(frames[7], case(local_v15_dir, "plain")["generated_audio_codes"][:3])
    assert finish[7] == "length"


def test_half_prefilled_newer_request_is_preempted_for_the_oldest_decoder(local_v15_model, local_v15_dir):
    """A newer prompt's chunked prefill takes the blocks the oldest decoder needs next: the newer
    request is preempted (half-prefilled), the decoder advances and both finish exactly."""
    old_prompt, new_prompt = case(local_v15_dir, "plain")["input_ids"], case(local_v15_dir, "voice_clone")["input_ids"]
    old, new = SamplingParams(greedy=True, forced_frames=40), SamplingParams(greedy=True, forced_frames=3)
    solo = {rid: run(LocalV15Runner(local_v15_model, max_running=1, kv_block_size=8, num_kv_blocks=32),
                     {rid: req})[0][rid]
            for rid, req in {1: (old_prompt, old), 2: (new_prompt, new)}.items()}
    # 19 blocks of 8: the decoder (68 rows + 40 frames) grows to 14 blocks, the new prompt needs 10
    runner = LocalV15Runner(local_v15_model, max_running=2, kv_block_size=8, num_kv_blocks=19,
                            prefill_chunk_tokens=4, max_prefill_tokens_per_step=4)
    runner.add(1, old_prompt, old)
    frames = {1: [], 2: []}
    while not frames[1]:
        frames[1] += [ev.codes for ev in runner.step()]
    assert runner.can_admit(len(new_prompt))
    runner.add(2, new_prompt, new)
    half_prefilled_victim = False
    for _ in range(200):
        if runner.num_running() == 0:
            break
        new_held = len(runner.cache.block_table(2))
        preemptions = runner.preemptions
        for ev in runner.step():
            if ev.codes is not None:
                frames[ev.rid].append(ev.codes)
        half_prefilled_victim |= runner.preemptions > preemptions and new_held > 0 and not frames[2]
    assert runner.num_running() == 0 and half_prefilled_victim
    for rid in (1, 2):
        np.testing.assert_array_equal(np.array(frames[rid]), solo[rid])
    assert runner.cache.num_used_blocks == 0
