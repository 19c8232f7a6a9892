"""The Local-v1.5 graph path on CPU (`graph_path="eager"`: the decode/frame graph bodies run on the
same bucketed, padded static inputs without capture): split steps (graph decode + eager prefill
chunks) emit exactly the events of the one-call eager runner, under staggered arrivals, forced
lengths and preemption; `prefill_interval` only moves prefill in time, never changes codes."""

import numpy as np
import pytest
import torch

from speech.sampling import SamplingParams
from stages.models.local_v15.config import tiny_config
from stages.models.local_v15.loader import build_talker_module
from stages.models.local_v15.runner import LocalV15Runner
from stages.runtime.row_scheduler import RowScheduler

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SETTINGS = [dict(greedy=True), dict(temperature=1.0, top_k=5), dict(top_p=0.5, repetition_penalty=1.3),
            dict(temperature=0.8, top_k=0, top_p=0.95), dict(repetition_penalty=1.1), dict(top_k=1),
            dict(text_temperature=1.5), dict(temperature=2.0, top_p=1.0)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_talker_module(tiny_config()).eval()


def workload(n=12, seed=0):
    """rid -> (arrival step, prompt [S, 13], params): prompt lengths 3..~100, mixed settings; most
    forced lengths, some left to the stop head / frame cap."""
    rng = np.random.default_rng(seed)
    reqs = {}
    for i in range(n):
        prompt = np.full((int(rng.integers(3, 100)), 13), 1024, np.int64)
        prompt[:, 0] = rng.integers(0, 600, len(prompt))
        forced = int(rng.integers(1, 14)) if i % 3 else None
        params = SamplingParams(seed=100 + i, forced_frames=forced, max_new_frames=int(rng.integers(6, 16)),
                                **SETTINGS[i % len(SETTINGS)])
        reqs[i] = (int(rng.integers(0, 25)), prompt, params)
    return reqs


def drive(runner, reqs, max_steps=2000):
    """Admit each request from its arrival step on (as capacity allows, in rid order); returns the
    per-step event lists and the scheduler's batches [(rid, rows fed, rows pending)] per step."""
    waiting = sorted(reqs, key=lambda rid: (reqs[rid][0], rid))
    steps, batches = [], []
    schedule = runner.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        batches.append([(r.rid, n, r.pending) for r, n in batch])
        return batch

    runner.scheduler.schedule = recording_schedule
    for t in range(max_steps):
        while waiting and reqs[waiting[0]][0] <= t and runner.can_admit(len(reqs[waiting[0]][1])):
            rid = waiting.pop(0)
            runner.add(rid, reqs[rid][1], reqs[rid][2])
        if not waiting and runner.num_running() == 0:
            break
        if runner.num_running() == 0:
            batches.append([])
        steps.append([(ev.rid, None if ev.codes is None else tuple(ev.codes), ev.finished, ev.reason)
                      for ev in runner.step()])
    assert not waiting and runner.num_running() == 0
    assert runner.cache.num_free_blocks == runner.cache.spec.num_blocks - (runner.graphs is not None)
    return steps, batches


def per_request(steps):
    """rid -> (codes [T, 12], finish reason)."""
    codes, finish = {}, {}
    for events in steps:
        for rid, c, finished, reason in events:
            if c is not None:
                codes.setdefault(rid, []).append(c)
            if finished:
                finish[rid] = reason
    return {rid: (np.array(codes.get(rid, []), np.int64).reshape(-1, 12), finish[rid]) for rid in finish}


def count_parts(runner):
    """Wrap the runner's two step parts to count the steps that ran both (split steps)."""
    counts = {"graph": 0, "eager": 0, "split": 0}
    graph_decode, eager_part = runner._graph_decode, runner._eager_part
    step = runner.step

    def counted_step():
        before = (counts["graph"], counts["eager"])
        events = step()
        counts["split"] += counts["graph"] > before[0] and counts["eager"] > before[1]
        return events

    def g(*a):
        counts["graph"] += 1
        return graph_decode(*a)

    def e(*a):
        counts["eager"] += 1
        return eager_part(*a)

    runner._graph_decode, runner._eager_part, runner.step = g, e, counted_step
    return counts


CAPACITY = dict(max_running=6, kv_block_size=8, num_kv_blocks=96, prefill_chunk_tokens=16,
                max_prefill_tokens_per_step=24)


def test_split_graph_steps_equal_the_eager_runner_event_for_event(model):
    reqs = workload()
    plain, _ = drive(LocalV15Runner(model, **CAPACITY), reqs)
    runner = LocalV15Runner(model, **CAPACITY, graph_path="eager")
    counts = count_parts(runner)
    graphed, _ = drive(runner, reqs)
    assert graphed == plain  # same events, same steps, same order
    assert counts["split"] >= 5  # many steps decoded from the graph path next to prefill chunks
    assert len(runner.graphs._graphs) >= 3 and len(runner.frame_graphs._graphs) >= 2  # several buckets
    done = per_request(plain)
    assert set(done) == set(reqs) and {"stop", "length"} <= {f for _, f in done.values()}
    assert sum(len(c) for c, _ in done.values()) >= 50


def test_split_graph_steps_with_preemption_are_exact(model):
    # 6 requests of 20..60 rows growing by 30..40 frames need ~60 blocks of 8; 30 force preemptions
    rng = np.random.default_rng(1)
    reqs = {}
    for i in range(6):
        prompt = np.full((20 + 8 * i, 13), 1024, np.int64)
        prompt[:, 0] = rng.integers(0, 600, len(prompt))
        params = SamplingParams(seed=200 + i, forced_frames=30 + 2 * i, max_new_frames=100,
                                **SETTINGS[i % len(SETTINGS)])
        reqs[i] = (3 * i, prompt, params)
    roomy = per_request(drive(LocalV15Runner(model, **CAPACITY), reqs)[0])
    tight_capacity = {**CAPACITY, "num_kv_blocks": 30}
    plain_runner = LocalV15Runner(model, **tight_capacity)
    plain, _ = drive(plain_runner, reqs)
    runner = LocalV15Runner(model, **tight_capacity, graph_path="eager")
    graphed, _ = drive(runner, reqs)
    assert runner.preemptions > 0 and runner.preemptions == plain_runner.preemptions
    assert graphed == plain
    tight = per_request(graphed)
    for rid in reqs:
        np.testing.assert_array_equal(tight[rid][0], roomy[rid][0], err_msg=str(rid))
        assert tight[rid][1] == roomy[rid][1]


def test_prompts_last_row_next_to_graph_decoders_keeps_schedule_order(model):
    """An older request whose prompt ends with a 1-row chunk is in the scheduler's decode list but
    not graph-decodable (its row is a prompt row): it runs in the eager part, yet its frame is
    reported in schedule order, before the newer request decoded from the graph."""
    rng = np.random.default_rng(3)
    older, newer = (np.stack([rng.integers(0, 600, n)] + [np.full(n, 1024)] * 12, 1) for n in (33, 3))
    reqs = {1: (0, older, SamplingParams(seed=1, forced_frames=4)),
            2: (0, newer, SamplingParams(seed=2, forced_frames=6))}
    plain, plain_batches = drive(LocalV15Runner(model, **CAPACITY), reqs)
    runner = LocalV15Runner(model, **CAPACITY, graph_path="eager")
    counts = count_parts(runner)
    graphed, batches = drive(runner, reqs)
    assert graphed == plain and batches == plain_batches
    # step 0: 16 + 3 rows (2 emits), step 1: 16 rows of 1 next to 2's decode, step 2: 1's last row
    assert [[(rid, n) for rid, n, _ in b] for b in batches[:3]] == [[(1, 16), (2, 3)], [(2, 1), (1, 16)],
                                                                      [(1, 1), (2, 1)]]
    assert [rid for rid, *_ in graphed[2]] == [1, 2] and counts["split"] >= 2


def prefill_steps_next_to_decoders(batches):
    """Indices of the steps that scheduled a prefill chunk while some request decoded."""
    return [t for t, batch in enumerate(batches)
            if any(pending > 1 for _, _, pending in batch) and any(pending == 1 for _, _, pending in batch)]


@pytest.mark.parametrize("graph_path", ["off", "eager"])
def test_prefill_interval_moves_prefill_but_not_codes(model, graph_path):
    reqs = workload(10, seed=2)
    base_steps, base_batches = drive(LocalV15Runner(model, **CAPACITY, graph_path=graph_path), reqs)
    runner = LocalV15Runner(model, **CAPACITY, graph_path=graph_path, prefill_interval=3)
    assert runner.scheduler.prefill_interval == 3
    steps, batches = drive(runner, reqs)
    base, spaced = per_request(base_steps), per_request(steps)
    assert set(base) == set(spaced) == set(reqs)
    for rid in reqs:
        np.testing.assert_array_equal(spaced[rid][0], base[rid][0], err_msg=str(rid))
        assert spaced[rid][1] == base[rid][1]
    # interval 1: prefill chunks next to decoders on consecutive steps; interval 3: after a step
    # that prefilled, the next two steps with decoders only decode
    base_mixed = prefill_steps_next_to_decoders(base_batches)
    assert any(b - a < 3 for a, b in zip(base_mixed, base_mixed[1:]))
    prefilled = [t for t, batch in enumerate(batches) if any(pending > 1 for _, _, pending in batch)]
    mixed = prefill_steps_next_to_decoders(batches)
    assert len(mixed) >= 5
    for t in mixed:
        earlier = [p for p in prefilled if p < t]
        assert not earlier or t - earlier[-1] >= 3, (t, earlier[-1])
    assert len(steps) > len(base_steps)  # new requests wait: later first frames


def test_prefill_runs_every_step_when_nothing_decodes(model):
    prompt = np.full((40, 13), 1024, np.int64)
    prompt[:, 0] = np.arange(40)
    runner = LocalV15Runner(model, **CAPACITY, prefill_interval=4)
    runner.add(1, prompt, SamplingParams(seed=1, forced_frames=3))
    lengths = []
    for _ in range(3):
        assert runner.step() == [] or len(lengths) == 2
        lengths.append(runner.cache.length(1))
    assert lengths == [16, 32, 40]  # two chunks and the rest (+ first frame) back to back


def test_graph_path_selection(model):
    assert LocalV15Runner(model, max_running=2, num_kv_blocks=8).graph_path == "off"
    assert LocalV15Runner(model, max_running=2, num_kv_blocks=8, cuda_graphs=True).graph_path == "off"  # CPU
    runner = LocalV15Runner(model, max_running=2, num_kv_blocks=8, graph_path="cuda")  # no capture off CUDA
    assert runner.graph_path == "eager" and not runner.graphs.capture and not runner.frame_graphs.capture
    assert runner.cache.spec.num_blocks == 9 and runner.cache.num_free_blocks == 8  # + the scratch block
    with pytest.raises(ValueError, match="graph_path"):
        LocalV15Runner(model, max_running=2, num_kv_blocks=8, graph_path="replay")
    with pytest.raises(ValueError, match="prefill_interval"):
        LocalV15Runner(model, max_running=2, num_kv_blocks=8, prefill_interval=0)


def test_sampler_mode_picks_the_cheap_paths_only_when_every_request_allows_them():
    from stages.models.local_v15.runner import SamplerMode
    from stages.runtime.sampling import K_CAP

    assert SamplerMode.of([SamplingParams(), SamplingParams(greedy=True, top_k=0)]) == SamplerMode(
        candidates=True, penalty=False)
    assert not SamplerMode.of([SamplingParams(), SamplingParams(top_k=0)]).candidates
    assert not SamplerMode.of([SamplingParams(top_k=K_CAP + 1)]).candidates
    assert SamplerMode.of([SamplingParams(), SamplingParams(repetition_penalty=1.1)]).penalty


@pytest.mark.parametrize("max_seqs", [None, 1])
def test_prefill_graphs_equal_the_eager_runner_event_for_event(model, max_seqs):
    """Prompt chunks replayed from prefill graphs (token and KV-block buckets, padding tokens on
    the scratch block, padding chunks empty) give exactly the events of the one-call eager runner,
    also under preemption; with room for one chunk a replay, steps of several fall back to eager."""
    reqs = workload()
    plain, _ = drive(LocalV15Runner(model, **CAPACITY), reqs)
    runner = LocalV15Runner(model, **CAPACITY, graph_path="eager", prefill_graphs=True)
    if max_seqs is not None:
        runner.prefill_graphs.max_seqs = max_seqs
    replays, run = [], runner.prefill_graphs.run
    runner.prefill_graphs.run = lambda chunks: replays.append(len(chunks)) or run(chunks)
    graphed, _ = drive(runner, reqs)
    assert graphed == plain
    keys = runner.prefill_graphs.keys
    assert len({M for _, M in keys}) >= 2  # several KV-block buckets
    if max_seqs is None:  # every prefill step replays a graph
        assert len({T for T, _ in keys}) >= 2 and max(replays) >= 2 and len(replays) >= 10
    else:  # steps of one chunk replay, the others ran eagerly
        assert replays and max(replays) == 1
    tight = {**CAPACITY, "num_kv_blocks": 30}
    plain_runner = LocalV15Runner(model, **tight)
    runner = LocalV15Runner(model, **tight, graph_path="eager", prefill_graphs=True)
    assert drive(runner, reqs)[0] == drive(plain_runner, reqs)[0]
    assert runner.preemptions == plain_runner.preemptions


def test_a_step_takes_no_more_prompt_chunks_than_a_prefill_replay_holds(model):
    """A burst of short prompts (as many prefix-cache hits make) is prefilled a replay's worth of
    chunks a step, never in one eager call for them all; only their first frames move, not their
    codes."""
    rng = np.random.default_rng(7)
    reqs = {}
    for i in range(6):
        prompt = np.full((int(rng.integers(3, 7)), 13), 1024, np.int64)
        prompt[:, 0] = rng.integers(0, 600, len(prompt))
        reqs[i] = (0 if i < 5 else 3, prompt, SamplingParams(seed=300 + i, forced_frames=6, **SETTINGS[i]))
    plain_steps, plain_batches = drive(LocalV15Runner(model, **CAPACITY), reqs)
    assert max(sum(pending > 1 for _, _, pending in b) for b in plain_batches) == 5  # one call for the burst
    runner = LocalV15Runner(model, **CAPACITY, graph_path="eager", prefill_graphs=True, prefill_graph_seqs=2)
    assert runner.scheduler.max_prefill_chunks == 2
    eager, pack = [], runner.scheduler.pack  # the eager prefill call's packing
    runner.scheduler.pack = lambda *a: eager.append(1) or pack(*a)
    steps, batches = drive(runner, reqs)
    chunks = [sum(pending > 1 for _, _, pending in b) for b in batches]
    assert max(chunks) == 2 and chunks[:3] == [2, 2, 1] and not eager
    assert any(pending == 1 for _, _, pending in batches[1])  # the first two decode beside the next chunks
    capped, plain = per_request(steps), per_request(plain_steps)
    assert set(capped) == set(plain) == set(reqs)
    for rid in reqs:
        np.testing.assert_array_equal(capped[rid][0], plain[rid][0], err_msg=str(rid))
    with pytest.raises(ValueError, match="max_prefill_chunks"):
        RowScheduler(runner.cache, max_running=2, max_prefill_chunks=0)


def test_a_prompt_left_with_one_row_counts_as_a_chunk():
    """A prompt whose other rows came from the prefix cache feeds one row, as a decoding request
    does, but through the prefill path: it counts against the step's chunk cap, decoders not;
    the cap can be lifted for a while (the talker's warm-up)."""
    from stages.runtime.kv_cache import KVCacheSpec, PagedKVCache

    cache = PagedKVCache(KVCacheSpec(1, 1, 2, 64, 4), dtype=torch.float32, device="cpu")
    s = RowScheduler(cache, max_running=12, prefill_chunk_tokens=8, max_prefill_tokens_per_step=64,
                     max_prefill_chunks=2)
    s.add(0, np.zeros((3, 13), np.int64))
    s.reserve(s.schedule())
    s.requests[0].rows.append(np.zeros(13, np.int64))  # its first frame: it decodes from now on
    for rid in range(1, 5):
        s.add(rid, np.zeros((1, 13), np.int64))  # one row each: pending 1 from the start
    s.add(5, np.zeros((6, 13), np.int64))
    steps = []
    for _ in range(3):
        batch = s.schedule()
        steps.append([(r.rid, n) for r, n in batch])
        s.reserve(batch)
        for r, _ in batch:
            if r.pending == 0:
                r.rows.append(np.zeros(13, np.int64))
    assert steps[0] == [(0, 1), (1, 1), (2, 1)]  # the decoder, then two one-row prompts
    assert steps[1] == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)]  # those two decode now
    assert steps[2] == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 6)]
    for rid in range(6, 10):
        s.add(rid, np.zeros((1, 13), np.int64))
    with s.chunks_uncapped():  # the warm-up's wide batch: every chunk in one step
        assert [r.rid for r, _ in s.schedule() if r.in_prompt] == [6, 7, 8, 9]
    assert s.max_prefill_chunks == 2


def test_token_buckets_pad_at_most_one_step():
    """Powers of two up to TOKEN_STEP, then its multiples: a 1123-token step pads to 1280."""
    from stages.runtime.prefill_graphs import TOKEN_STEP, token_bucket

    assert [token_bucket(n, 4096) for n in (1, 16, 17, 200, 256, 257, 1123, 4000, 4096)] == \
        [16, 16, 32, 256, 256, 512, 1280, 4096, 4096]
    assert token_bucket(300, 300) == 300 and token_bucket(5000, 4096) == 5000
    assert all(token_bucket(n, 8192) - n < TOKEN_STEP for n in range(1, 8192))


def test_prefill_graphs_of_one_table_width_equal_the_eager_runner(model):
    """With one block-table width for every bucket (an attention backend that reads a table only
    as far as its sequence's length), there is one graph per token bucket; events stay exact, and
    chunks whose tables are wider than it run eagerly."""
    reqs = workload()
    plain, _ = drive(LocalV15Runner(model, **CAPACITY), reqs)
    runner = LocalV15Runner(model, **CAPACITY, graph_path="eager", prefill_graphs=True)
    runner.prefill_graphs.table_width = 4  # 32 tokens: longer sequences' chunks run eagerly
    replays, run = [], runner.prefill_graphs.run
    runner.prefill_graphs.run = lambda chunks: replays.append(len(chunks)) or run(chunks)
    eager, pack = [], runner.scheduler.pack  # the eager prefill call's packing
    runner.scheduler.pack = lambda *a: eager.append(1) or pack(*a)
    graphed, _ = drive(runner, reqs)
    assert graphed == plain
    assert {M for _, M in runner.prefill_graphs.keys} == {4} and replays and eager
    fresh = LocalV15Runner(model, **CAPACITY, graph_path="eager", prefill_graphs=True)
    fresh.prefill_graphs.table_width = 4
    assert fresh.capture_prefill_graphs(60.0) == 2 and fresh.capture_prefill_graphs(60.0) == 0
    assert sorted(fresh.prefill_graphs.keys) == sorted(runner.prefill_graphs.keys) == [(16, 4), (24, 4)]


def test_prefill_graphs_capture_ahead_leaves_requests_alone(model):
    reqs = workload(6, seed=4)
    plain, _ = drive(LocalV15Runner(model, **CAPACITY), reqs)
    runner = LocalV15Runner(model, **CAPACITY, graph_path="eager", prefill_graphs=True)
    made = runner.prefill_graphs.capture_ahead([1, 20, 24], [1, 3])
    assert made == len(runner.prefill_graphs.keys) == 4  # tokens 16, 24 (the budget) x blocks 1, 4
    # the runner's own: 4 sampler modes x (4 x 8 decode + 4 local-loop graphs), then every token
    # bucket up to the budget x block buckets up to the pool's 96 (4 of them made above)
    assert runner.capture_ahead(60.0) == 4 * (4 * 8 + 4) + 2 * 8 - 4 and runner.capture_ahead(60.0) == 0
    assert drive(runner, reqs)[0] == plain
    assert LocalV15Runner(model, **CAPACITY, graph_path="eager").capture_ahead(60.0) == 4 * (4 * 8 + 4)  # no prefill
    assert LocalV15Runner(model, **CAPACITY).capture_ahead(60.0) == 0  # no graphs at all


def test_capture_ahead_makes_every_graph_serving_meets(model):
    """After one warm-up request, `capture_ahead` makes every decode, local-loop and prefill graph
    of the requests' sampler mode: serving a whole workload then makes no graph of its own."""
    reqs = {rid: (arrival, prompt, SamplingParams(seed=params.seed, forced_frames=params.forced_frames,
                                                  max_new_frames=params.max_new_frames, temperature=1.0, top_k=5))
            for rid, (arrival, prompt, params) in workload(10, seed=5).items()}
    runner = LocalV15Runner(model, **CAPACITY, graph_path="eager", prefill_graphs=True)
    warm = {-1: (0, reqs[0][1][:5], SamplingParams(seed=1, forced_frames=2, temperature=1.0, top_k=5))}
    drive(runner, warm)
    made = runner.capture_ahead(120.0)

    def graphs():
        return ({(mode, key) for mode, (d, _) in runner._graph_sets.items() for key in d._graphs},
                {(mode, key) for mode, (_, f) in runner._graph_sets.items() for key in f._graphs},
                set(runner.prefill_graphs.keys))

    before = graphs()
    # 4 sampler modes x (batch buckets 1, 2, 4, 6 x KV-block buckets 1 .. 64, 96; local loops
    # 1, 2, 4, 6), then prefill tokens 16, 24 x the block buckets
    assert [len(g) for g in before] == [4 * 4 * 8, 4 * 4, 2 * 8]
    assert made > 150  # the warm-up request made a few itself
    drive(runner, reqs)
    assert graphs() == before


def test_decode_graphs_of_one_table_width_equal_the_eager_runner(model):
    """With one block-table width (an attention that reads a table only as far as its sequence's
    length), a decode graph per batch bucket serves every table that fits it, longer ones get
    bucketed widths; events stay exact. Captured after a warm-up request, the graphs of every
    batch bucket are all a workload of that sampler mode needs: serving it makes none."""
    reqs = workload()
    plain, _ = drive(LocalV15Runner(model, **CAPACITY), reqs)
    runner = LocalV15Runner(model, **CAPACITY, graph_path="eager")
    runner.graph_table_width = lambda: 4  # 32 tokens
    graphed, _ = drive(runner, reqs)
    assert graphed == plain
    widths = {M for decode, _ in runner._graph_sets.values() for _, M in decode._graphs}
    assert 4 in widths and min(widths) == 4 and max(widths) > 4

    one_mode = {rid: (arrival, prompt, SamplingParams(seed=params.seed, forced_frames=params.forced_frames,
                                                      max_new_frames=params.max_new_frames, temperature=1.0,
                                                      top_k=5))
                for rid, (arrival, prompt, params) in workload(10, seed=6).items()}
    plain, _ = drive(LocalV15Runner(model, **CAPACITY), one_mode)
    fresh = LocalV15Runner(model, **CAPACITY, graph_path="eager")
    fresh.graph_table_width = lambda: 16  # 128 tokens: every table of this workload
    assert fresh.capture_decode_graphs(60.0) == 0  # no sampler mode met yet
    drive(fresh, {-1: (0, one_mode[0][1][:5], SamplingParams(seed=1, forced_frames=2, temperature=1.0, top_k=5))})
    made = fresh.capture_decode_graphs(60.0)
    before = {(mode, key) for mode, (d, f) in fresh._graph_sets.items() for key in (*d._graphs, *f._graphs)}
    assert made > 0 and fresh.capture_decode_graphs(60.0) == 0
    assert {key for _, key in before} == {(1, 16), (2, 16), (4, 16), (6, 16), 1, 2, 4, 6}
    assert drive(fresh, one_mode)[0] == plain
    assert {(mode, key) for mode, (d, f) in fresh._graph_sets.items() for key in (*d._graphs, *f._graphs)} == before
    assert LocalV15Runner(model, **CAPACITY, graph_path="eager").capture_decode_graphs(60.0) == 0  # bucketed widths


def test_batch_buckets_pad_little_past_32_rows():
    from stages.runtime.graph_capture import batch_bucket, batch_buckets

    assert [batch_bucket(n, 256) for n in (1, 3, 17, 32, 33, 87, 129, 256)] == [1, 4, 32, 32, 64, 96, 160, 256]
    assert batch_bucket(300, 256) == 300 and batch_bucket(85, 90) == 90 and batch_bucket(5, 6) == 6
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert all(batch_bucket(n, 256) - n < 32 for n in range(1, 257))


def test_make_missing_makes_the_absent_keys_largest_first_within_the_budget():
    from stages.runtime.graph_capture import make_missing

    order = []
    assert make_missing([(1, 4), (8, 4), (2, 4), (8, 4)], {(2, 4)}, order.append, None) == 2
    assert order == [(8, 4), (1, 4)]  # (2, 4) was made already; duplicates once
    assert make_missing([1, 2, 3], set(), order.append, -1.0) == 0  # the budget has passed
