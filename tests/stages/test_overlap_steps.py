"""The Local-v1.5 talker one step ahead (`talker.overlap_steps`): each step is launched before the
one before it is read back, and every request still gets exactly its frames and finish, in order,
through stops decided by the model, forced lengths, frame caps, preemption and aborts."""

import numpy as np
import pytest
import torch

from profiles import load_profile
from speech.sampling import SamplingParams
from stages.models.local_v15.runner import MIXED_MIN_DECODE, LocalV15Runner, load_talker_runner
from tests.conftest import golden_dir
from tests.stages.test_local_v15_runner import mixed_requests
from tests.stages.test_mixed_steps import requests


def run(runner, arrivals, aborts=(), max_steps=400):
    """Every event per request (codes or None, finished, reason) with the step it came in."""
    out: dict[int, list] = {}
    step = 0
    for step in range(max_steps):
        for rid, prompt, params in arrivals.get(step, []):
            runner.add(rid, prompt, params)
        for rid, at in aborts:
            if at == step:
                runner.remove(rid)
        events = runner.step()
        for e in events:
            out.setdefault(e.rid, []).append((None if e.codes is None else tuple(e.codes), e.finished, e.reason))
        if step > max(arrivals) and runner.num_running() == 0 and not events:
            break  # (one step ahead, the last events come in the call after the last request left)
    return out


@pytest.mark.parametrize("prefill_graphs", [False, True])
def test_one_step_ahead_gives_every_request_the_same_events(local_v15_model, local_v15_dir, prefill_graphs):
    reqs = mixed_requests(local_v15_dir)  # seeded: forced lengths, and stops by the model at once
    items = list(reqs.items())
    with np.load(local_v15_dir / "case_plain.npz") as z:
        plain_prompt = z["input_ids"]  # greedy stops by itself after 15 frames
    arrivals = {0: [(rid, *req) for rid, req in items[:3]], 2: [(rid, *req) for rid, req in items[3:6]],
                5: [(rid, *req) for rid, req in items[6:]],
                1: [(200, plain_prompt, SamplingParams(greedy=True, max_new_frames=4)),  # its frame cap
                    (201, plain_prompt, SamplingParams(greedy=True, max_new_frames=100)),  # the model's stop
                    (202, plain_prompt, SamplingParams(greedy=True, max_new_frames=17))]}  # a stop, then the cap
    kw = dict(max_running=12, kv_block_size=8, num_kv_blocks=200, prefill_chunk_tokens=32,
              max_prefill_tokens_per_step=64, graph_path="eager", prefill_graphs=prefill_graphs)
    plain = run(LocalV15Runner(local_v15_model, **kw), arrivals)
    ahead = LocalV15Runner(local_v15_model, overlap_steps=True, **kw)
    got = run(ahead, arrivals)
    assert got == plain
    assert all(evs[-1][1] for evs in plain.values()) and plain[200][-1][2] == "length"
    assert len(plain[200]) == 4 and len(plain[201]) == 16 and plain[201][-1] == (None, True, "stop")
    assert plain[202] == plain[201]  # it stops one frame before its cap: one finish, not two
    assert ahead._pending is None and ahead.num_running() == 0
    assert ahead.cache.num_used_blocks == 1  # every block back (the graphs' scratch block stays)


def test_one_step_ahead_through_preemption_and_an_abort(local_v15_model, local_v15_dir):
    with np.load(local_v15_dir / "case_voice_clone.npz") as z:
        prompt = z["input_ids"]
    params = [SamplingParams(seed=i, forced_frames=30 + 5 * i, temperature=1.0, top_k=20) for i in range(3)]
    arrivals = {0: [(i, prompt[: 75 - 9 * i], params[i]) for i in range(3)], 4: [(9, prompt, params[0])]}
    kw = dict(max_running=4, kv_block_size=8, num_kv_blocks=34, graph_path="eager")  # too few: preemption
    plain_runner = LocalV15Runner(local_v15_model, **kw)
    plain = run(plain_runner, arrivals, aborts=[(9, 12)])
    ahead = LocalV15Runner(local_v15_model, overlap_steps=True, **kw)
    got = run(ahead, arrivals, aborts=[(9, 12)])
    assert plain_runner.preemptions > 0 and ahead.preemptions > 0
    for rid in (0, 1, 2):
        assert got[rid] == plain[rid]
        assert len(got[rid]) == params[rid].forced_frames and got[rid][-1][1:] == (True, "stop")
    assert not any(f for _, f, _ in got.get(9, []))  # aborted: no finish event
    assert ahead.num_running() == 0 and ahead.cache.num_used_blocks == 1


def test_profile_switch_and_no_overlap_without_graphs(local_v15_model, local_v15_dir, monkeypatch):
    import stages.models.local_v15.runner as module

    made = []
    monkeypatch.setattr(module, "LocalV15Runner", lambda local_v15_model, **kw: made.append(kw))
    load_talker_runner(local_v15_dir, load_profile("cpu", ["talker.overlap_steps=true"]), "cpu")
    load_talker_runner(local_v15_dir, load_profile("cpu"), "cpu")
    assert [kw["overlap_steps"] for kw in made] == [True, False]
    monkeypatch.undo()
    # without graphs a decode row is packed from the host rows: no step can be planned ahead
    assert not LocalV15Runner(local_v15_model, max_running=2, num_kv_blocks=16, overlap_steps=True).overlap_steps
    # timing steps on the GPU is a CUDA matter: on the CPU nothing is timed
    runner = LocalV15Runner(local_v15_model, max_running=2, num_kv_blocks=16)
    runner.time_steps()
    assert runner._clock is None and runner.take_step_times() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_step_ahead_from_captured_graphs_on_the_gpu():
    """Decode and prefill graphs captured, results through the pinned buffers: the same events
    one step ahead as step by step (tiny, fp32)."""
    from stages.models.local_v15.config import tiny_config
    from stages.models.local_v15.loader import build_talker_module

    torch.manual_seed(0)
    model = build_talker_module(tiny_config()).cuda().eval()
    rng = np.random.default_rng(0)
    arrivals = {}
    for i in range(6):
        p = np.full((20 + 9 * i, 13), 1024, np.int64)
        p[:, 0] = rng.integers(0, 600, len(p))
        params = SamplingParams(seed=i, forced_frames=None if i % 3 == 0 else 6 + 2 * i, max_new_frames=12)
        arrivals.setdefault(2 * (i // 2), []).append((i, p, params))
    kw = dict(max_running=8, num_kv_blocks=64, kv_block_size=8, prefill_chunk_tokens=16,
              max_prefill_tokens_per_step=32, cuda_graphs=True, prefill_graphs=True)
    plain = run(LocalV15Runner(model, **kw), arrivals)
    ahead = LocalV15Runner(model, overlap_steps=True, **kw)
    got = run(ahead, arrivals)
    assert ahead.overlap_steps and ahead._result_buffers and ahead._result_buffers[0].is_pinned()
    assert got == plain and all(evs[-1][1] for evs in got.values())
    # timed on the GPU (for a timeline), both ways: the same events, and each step read back
    # gives its span and the GPU's idle time before it (none for the first)
    for overlap in (False, True):
        timed = LocalV15Runner(model, overlap_steps=overlap, **kw)
        timed.time_steps()
        assert run(timed, arrivals) == plain
        times = timed.take_step_times()
        assert len(times) >= max(len(evs) for evs in plain.values()) and timed.take_step_times() == []
        assert times[0].idle_ms is None and all(t.idle_ms >= 0 for t in times[1:])
        assert all(t.span_ms > 0 for t in times)
        # each span carries its own step's work: every prompt token prefilled once
        assert sum(t.prefill_tokens for t in times) == sum(20 + 9 * i for i in range(6))


def test_the_talker_loop_one_step_ahead_sends_the_same_chunks(local_v15_model, local_v15_dir):
    """The worker's loop over real rings: a request's code chunks (sizes, codes, final) are the
    same one step ahead, its last chunk a step later at most."""
    from stages.registry import load_variant
    from tests.stages.test_variants_delay_realtime import LoopRig

    profile = load_profile("cpu", [f"model.codec_path={golden_dir('moss_audio_tokenizer_v2')}"])
    variant = load_variant(local_v15_dir, profile)
    job = variant.warm_up_job()
    job.forced_frames, job.sampling = 23, {"seed": 4}
    request = variant.build_request(job)
    got = {}
    for ahead in (False, True):
        rig = LoopRig(LocalV15Runner(local_v15_model, max_running=2, num_kv_blocks=32, graph_path="eager",
                                     overlap_steps=ahead), variant, profile)
        try:
            got[ahead] = rig.chunks_until_done(request, 1)
        finally:
            rig.close()
    assert [(c.seq, c.final, codes.tolist()) for _, _, c, codes in got[True]] == \
           [(c.seq, c.final, codes.tolist()) for _, _, c, codes in got[False]]
    assert sum(len(codes) for *_, codes in got[True]) == 23 and got[True][-1][2].final
    assert got[True][-1][0] <= got[False][-1][0] + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mixed_step_tokens", [0, 128])
def test_a_step_one_ahead_never_waits_for_the_gpu(mixed_step_tokens):
    """Once its graphs are made, a runner one step ahead makes no call that waits for the GPU
    while requests arrive, run and finish (a Python value written into a device tensor, a
    blocking copy, `.item()` would wait for the step in flight and undo the overlap): torch's
    sync check set to raise finds none; the one wait is on the previous step's event. Twenty
    requests decode to their forced lengths while three more join (one left to its stop head):
    with `mixed_step_tokens` those join in a mixed step."""
    from stages.models.local_v15.config import tiny_config
    from stages.models.local_v15.loader import build_talker_module
    from stages.runtime.attention.triton_paged import TritonPagedAttention

    torch.manual_seed(0)
    model = build_talker_module(tiny_config()).cuda().eval()
    rng = np.random.default_rng(0)

    def arrivals(first_rid: int) -> dict:
        """The same lengths and steps each time, fresh random prompts (no prefix is shared)."""
        out = {}
        for i in range(23):
            p = np.full((20 + 3 * (i % 7), 13), 1024, np.int64)
            p[:, 0] = rng.integers(0, 600, len(p))
            params = SamplingParams(seed=i, forced_frames=None if i == 21 else 8 + i % 5, max_new_frames=14,
                                    temperature=0.9, top_k=30, repetition_penalty=1.1 if i % 2 else 1.0)
            out.setdefault(0 if i < 20 else 4, []).append((first_rid + i, p, params))
        return out

    # the server's attention on CUDA: one block-table width, which mixed steps need
    runner = LocalV15Runner(model, overlap_steps=True, max_running=24, num_kv_blocks=160, kv_block_size=8,
                            prefill_chunk_tokens=512, max_prefill_tokens_per_step=2048, cuda_graphs=True,
                            prefill_graphs=True, mixed_step_tokens=mixed_step_tokens,
                            attention=TritonPagedAttention())
    assert runner.mixed_step_tokens == mixed_step_tokens
    run(runner, arrivals(0))  # makes every graph these arrivals meet
    mixed = []
    launch = runner._mixed_part
    runner._mixed_part = lambda *a: mixed.append(1) or launch(*a)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run(runner, arrivals(100))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sorted(got) == list(range(100, 123)) and all(evs[-1][1] for evs in got.values())
    assert bool(mixed) == bool(mixed_step_tokens)


def test_steps_one_ahead_hold_no_op_that_would_wait_for_the_gpu(local_v15_model, local_v15_dir):
    """The CPU twin of the GPU check above: while a one-ahead runner admits, steps (decode,
    prefill and mixed) and finishes requests, no op outside the graphs' bodies reads a device value
    on the host (`.item()`, `nonzero`) or writes a host scalar into a tensor (a blocking copy on
    CUDA, which waits for the step in flight); index writes take the runner's device-held value."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import stages.runtime.graph_capture as graph_capture

    runner = LocalV15Runner(local_v15_model, overlap_steps=True, max_running=24, kv_block_size=8,
                            num_kv_blocks=24 * 16, prefill_chunk_tokens=512, max_prefill_tokens_per_step=2048,
                            graph_path="eager", prefill_graphs=True, mixed_step_tokens=256)
    reqs = requests(local_v15_dir, MIXED_MIN_DECODE + 3)  # forced lengths, several sampler settings
    arrivals = {0: [(rid, *reqs[rid]) for rid in range(MIXED_MIN_DECODE)],
                3: [(rid, *reqs[rid]) for rid in range(MIXED_MIN_DECODE, MIXED_MIN_DECODE + 3)]}
    inside, waits = [0], []
    replay = graph_capture.run_eager

    def body(*a):  # a graph's body: recorded on CUDA, so nothing in it runs on the host
        inside[0] += 1
        try:
            return replay(*a)
        finally:
            inside[0] -= 1

    class Waits(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            value = args[1] if name == "aten.copy_" else args[2] if name.startswith("aten.index_put") else None
            if not inside[0] and (name in ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select")
                                  or (isinstance(value, torch.Tensor) and value.dim() == 0
                                      and value is not runner._true)):
                waits.append(name)
            return func(*args, **(kwargs or {}))

    mixed = []
    launch = runner._mixed_part
    runner._mixed_part = lambda *a: mixed.append(1) or launch(*a)
    graph_capture.run_eager = body
    try:
        with Waits():
            got = run(runner, arrivals)
    finally:
        graph_capture.run_eager = replay
    assert len(got) == MIXED_MIN_DECODE + 3 and all(evs[-1][1] for evs in got.values()) and mixed
    assert waits == []
