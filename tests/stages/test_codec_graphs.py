"""Decode graphs (`stages.models.codec.graphs`): bucketed, padded decode with a scratch slot gives the same
PCM as the plain runner for every request, whatever joins or leaves; on CUDA real graph replay
equals eager decode."""

import numpy as np
import pytest
import torch

from bench.codec import random_codec
from stages.models.codec.config import CodecConfig, tiny_v2_config
from stages.models.codec.dispatch_plan import CallCost
from stages.models.codec.graphs import bucket
from stages.models.codec.runner import CodecRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_VQ, MAX_SLOTS, MAX_CHUNK = 12, 6, 15  # 6 slots: buckets 1, 2, 4 and 6 (capped)


def tiny_model(device: str = "cpu"):
    return random_codec(CodecConfig.from_json(tiny_v2_config()), device, torch.float32, seed=3)


def script(seed: int = 0) -> list[list[tuple[int, np.ndarray | None]]]:
    """Decode calls of (rid, codes [T, n_vq]); codes None = close the request after this call.

    Requests follow the 1, 2, 4, 15, ... schedule (some with a final partial chunk or an empty
    terminal one), start at different calls and leave mid-way, so batches of 1..6 chunks of equal
    length need padding to their bucket and padding rows reuse rows that held real slots before.
    One 20-frame chunk exceeds the ring headroom (graph-sized pieces, 15 + 5)."""
    rng = np.random.default_rng(seed)
    schedules = {
        1: [1, 2, 4, 15, 15, 3],
        2: [1, 2, 4, 15, 7],
        3: [1, 2, 4, 15, 15, 15, 0],
        4: [1, 2, 4, 20, 15, 5],
        5: [1, 2, 4, 15, 1],
        6: [1, 2, 4],
        7: [1, 2, 4, 15, 15, 2],
        8: [1, 2, 4, 15],
    }
    # five start together (5 rows -> bucket 8 capped at 6), 6 joins one call later; 7 and 8 take the
    # slots freed by 6, 2 and 5; in call 4 three 15-frame chunks pad to 4 rows, one of which held a
    # real slot in call 3
    starts = {1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 1, 7: 4, 8: 5}
    calls = []
    for step in range(12):
        items = []
        for rid, sizes in schedules.items():
            k = step - starts[rid]
            if 0 <= k < len(sizes):
                codes = rng.integers(0, 1024, (sizes[k], N_VQ), dtype=np.int64)
                items.append((rid, codes, k == len(sizes) - 1))
        calls.append(items)
    return calls


def play(runner: CodecRunner, calls, made: list | None = None) -> dict[int, np.ndarray]:
    """Run the script; PCM [channels, samples] per request, every leased slot checked; `made`
    gets each decode's model calls (`last_calls`)."""
    pcm: dict[int, list[np.ndarray]] = {}
    for items in calls:
        for rid, _, _ in items:
            if rid not in runner._slot_of:
                runner.open(rid)
        assert all(0 <= s < runner.max_slots for s in runner._slot_of.values())  # never the scratch slot
        outs = runner.decode([(rid, codes) for rid, codes, _ in items])
        if made is not None:
            made.append(list(runner.last_calls))
        for (rid, codes, last), out in zip(items, outs):
            assert out.shape == (runner.channels, codes.shape[0] * runner.samples_per_frame)
            pcm.setdefault(rid, []).append(out.copy())  # a view valid until the next decode
            if last:
                runner.close(rid)
    assert runner.num_open() == 0
    return {rid: np.concatenate(parts, axis=1) for rid, parts in pcm.items()}


def test_bucket():
    assert [bucket(n, 8) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert [bucket(n, 6) for n in (3, 5, 6)] == [4, 6, 6]
    # past 16 rows, multiples of 16: a padding row costs as much as a real one
    assert [bucket(n, 256) for n in (16, 17, 33, 48, 49, 250)] == [16, 32, 48, 48, 64, 256]
    assert bucket(90, 90) == 90  # capped
    with pytest.raises(ValueError):
        bucket(7, 6)


@pytest.mark.parametrize("fixed_ms", [0.0, 10.0, 1e6])
def test_padded_graphs_give_every_stream_its_own_audio(fixed_ms):
    """Buckets padded with scratch-slot rows, and chunks of any lengths padded into shared replays
    (each row advancing by its real frames only), give every stream the PCM of the plain runner,
    whatever joins or leaves: with no per-call cost the planner makes a replay per length (and
    merges only where the batch bucket pads anyway); with a huge one every dispatch is one replay."""
    model = tiny_model()
    calls = script()
    plain = play(CodecRunner(model, n_vq=N_VQ, max_slots=MAX_SLOTS, max_chunk_frames=MAX_CHUNK), calls)
    runner = CodecRunner(model, n_vq=N_VQ, max_slots=MAX_SLOTS, max_chunk_frames=MAX_CHUNK, graphs_eager=True)
    assert runner._decoder.num_slots == MAX_SLOTS + 1 and runner.graphs.scratch_slot == MAX_SLOTS
    runner.call_cost = CallCost(fixed_ms=fixed_ms)
    replays, decode = [], runner.graphs.decode
    runner.graphs.decode = lambda *a: replays.append(a[0].shape[-1]) or decode(*a)
    padded = play(runner, calls)
    keys = set(runner.graphs.keys)
    lengths = {T for _, T in keys}
    assert not {3, 7} & lengths  # final lengths 3 and 7: padded into a call length
    assert all(T <= MAX_CHUNK for T in lengths)  # the 20-frame chunk decoded in pieces
    if fixed_ms == 0.0:
        assert {(6, 1), (4, 15)} <= keys
    planned = sum(any(0 < len(c) <= MAX_CHUNK for _, c, _ in items) for items in calls)
    if fixed_ms == 1e6:  # one replay per call (plus the 20-frame chunk's two pieces)
        assert len(replays) == planned + 2
    elif fixed_ms == 0.0:  # a replay per length
        assert len(replays) > planned + 2
    assert padded.keys() == plain.keys()
    whole_codes = np.concatenate([c for items in calls for r, c, _ in items if r == 4])
    whole = model.decode(torch.from_numpy(whole_codes.T[:, None, :].copy()))[0].numpy()
    assert np.abs(padded[4] - whole).max() < 1e-4  # and chunked decoding is still the whole decode
    for rid in plain:
        assert padded[rid].shape == plain[rid].shape
        # other shapes, other float summation order: equal to fp32 rounding of the signal's scale
        assert np.abs(padded[rid] - plain[rid]).max() <= 1e-5 * np.abs(plain[rid]).max(), rid


@pytest.mark.parametrize("row_frame_ms", [1.0, 0.0452])
def test_chunks_cut_into_rows_give_every_stream_its_own_audio(row_frame_ms):
    """With `split_chunks` a dispatch's longer chunks go into shorter replays as several rows of
    their slot (`plan_pieces`): every stream still gets the plain runner's PCM, whatever joins or
    leaves. With a per-call cost that dwarfs the rest every dispatch is one replay, and with padded
    frames the dear part, ramp and steady chunks share a short one: chunks were cut."""
    model = tiny_model()
    calls = script()
    plain = play(CodecRunner(model, n_vq=N_VQ, max_slots=MAX_SLOTS, max_chunk_frames=MAX_CHUNK), calls)
    runner = CodecRunner(model, n_vq=N_VQ, max_slots=32, max_chunk_frames=MAX_CHUNK, graphs_eager=True,
                         split_chunks=True)
    runner.call_cost = CallCost(fixed_ms=1e6, row_ms=0.0, row_frame_ms=row_frame_ms)
    made: list = []
    cut = play(runner, calls, made)
    chunks = [sum(0 < len(c) <= MAX_CHUNK for _, c, _ in items) for items in calls]
    # besides: a 20-frame chunk (15 + 5, in turn) and the empty terminal chunks (one eager call)
    extra = [2 * sum(len(c) > MAX_CHUNK for _, c, _ in items) + any(len(c) == 0 for _, c, _ in items)
             for items in calls]
    assert [len(m) for m, n in zip(made, chunks) if n] == [1 + k for k, n in zip(extra, chunks) if n]
    assert any(m[0][0] > n for m, n in zip(made, chunks) if n)  # more rows than chunks: some were cut
    assert cut.keys() == plain.keys()
    for rid in plain:
        assert cut[rid].shape == plain[rid].shape
        assert np.abs(cut[rid] - plain[rid]).max() <= 1e-5 * np.abs(plain[rid]).max(), rid


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ring_attention", [False, True, "fused", "one_kernel"])
def test_cuda_graphs_of_cut_chunks_equal_the_plain_runner(ring_attention):
    """Recorded replays of cut chunks (duplicate slots in one graph: the counters' scatter, the
    rows' ring writes and attention, in place or copied; "fused": in place with RoPE and the ring
    writes in one kernel and the residual adds with their LayerNorms; "one_kernel": and the
    attention in the ring writes' kernel, a cut chunk's pieces in one program) give every stream
    the plain runner's audio, as the eager graph logic does on CPU."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        model = tiny_model("cuda")
        calls = script(seed=4)
        plain = play(CodecRunner(model, n_vq=N_VQ, max_slots=MAX_SLOTS, max_chunk_frames=MAX_CHUNK), calls)
        if ring_attention:
            fused = ring_attention in ("fused", "one_kernel")
            model.use_ring_attention(fused_writes=fused, fused_norms=fused,
                                     fused_attention=ring_attention == "one_kernel")
        runner = CodecRunner(model, n_vq=N_VQ, max_slots=32, max_chunk_frames=MAX_CHUNK, cuda_graphs=True,
                             split_chunks=True)
        runner.call_cost = CallCost(fixed_ms=1e6, row_ms=0.0, row_frame_ms=1.0)
        made: list = []
        cut = play(runner, calls, made)
        model.use_ring_attention(0)
        assert all(e.graph is not None for e in runner.graphs._entries.values())
        chunks = [sum(0 < len(c) <= MAX_CHUNK for _, c, _ in items) for items in calls]
        assert any(m[0][0] > n for m, n in zip(made, chunks) if n)  # some chunks were cut
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    for rid in plain:
        scale = max(1.0, float(np.abs(plain[rid]).max()))
        assert np.abs(cut[rid] - plain[rid]).max() <= 1e-4 * scale, rid


def test_split_chunks_refuse_decode_lanes():
    with pytest.raises(ValueError, match="split_chunks"):
        CodecRunner(tiny_model(), n_vq=N_VQ, max_slots=4, graphs_eager=True, decode_lanes=2, split_chunks=True)


def test_capture_ahead_makes_buckets_and_leaves_open_requests_alone():
    model = tiny_model()
    codes = np.random.default_rng(1).integers(0, 1024, (16, N_VQ), dtype=np.int64)
    ref = CodecRunner(model, n_vq=N_VQ, max_slots=MAX_SLOTS)
    ref.open(1)
    want = [ref.decode([(1, codes[:1])])[0], ref.decode([(1, codes[1:16])])[0]]
    runner = CodecRunner(model, n_vq=N_VQ, max_slots=MAX_SLOTS, graphs_eager=True)
    runner.open(1)
    got = [runner.decode([(1, codes[:1])])[0].copy()]  # a view valid until the next decode
    assert runner.capture((1, 2, 3, 100), (1, 15, 40)) == 7  # buckets 1, 2, 4, 6 x T 1, 15; (1, 1) existed
    assert runner.capture((1, 2), (1, 15)) == 0
    got.append(runner.decode([(1, codes[1:16])])[0])
    for g, w in zip(got, want):
        assert np.abs(g - w).max() <= 1e-6
    assert CodecRunner(model, n_vq=N_VQ, max_slots=2).capture((1,), (1,)) == 0  # no graphs: nothing


def test_cuda_graphs_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        CodecRunner(tiny_model(), n_vq=N_VQ, max_slots=2, cuda_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager():
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        model = tiny_model("cuda")
        calls = script(seed=2)
        kw = dict(n_vq=N_VQ, max_slots=MAX_SLOTS, max_chunk_frames=MAX_CHUNK)
        plain = play(CodecRunner(model, **kw), calls)
        eager = play(CodecRunner(model, **kw, graphs_eager=True), calls)
        runner = CodecRunner(model, **kw, cuda_graphs=True)
        runner.capture((1, 2), (1, 2))  # some ahead, the rest captured lazily while requests are open
        graphed = play(runner, calls)
        assert all(e.graph is not None for e in runner.graphs._entries.values())
        assert len(runner.graphs.keys) >= 8
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    for rid in plain:
        scale = max(1.0, float(np.abs(plain[rid]).max()))
        assert np.abs(graphed[rid] - eager[rid]).max() <= 1e-6 * scale, rid  # same shapes, same kernels
        assert np.abs(graphed[rid] - plain[rid]).max() <= 1e-4 * scale, rid  # other batch shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_bf16_replay_equals_padded_eager():
    model = tiny_model("cuda").to(torch.bfloat16)
    model.quantizer.float()
    calls = script(seed=4)
    kw = dict(n_vq=N_VQ, max_slots=MAX_SLOTS, max_chunk_frames=MAX_CHUNK)
    eager = play(CodecRunner(model, **kw, graphs_eager=True), calls)
    graphed = play(CodecRunner(model, **kw, cuda_graphs=True), calls)
    for rid in eager:  # bf16: allow kernel-level rounding noise; a corrupted stream is off by O(1)
        scale = max(1.0, float(np.abs(eager[rid]).max()))
        assert np.abs(graphed[rid] - eager[rid]).max() <= 1e-2 * scale, rid


def test_decode_lanes_share_a_dispatch_and_give_every_stream_its_own_audio():
    """With `decode_lanes`, a dispatch's replays go to the lanes in turn (each lane its own graph
    entries over the one decoder's slots), a dispatch planned into fewer calls than lanes is split
    (`dispatch_plan.spread`), and every stream gets the PCM of one lane: the same replays on other
    graph sets, or halves of them (other batch buckets: float rounding, where a corrupted stream
    would be off by O(1))."""
    model = tiny_model()
    calls = script(seed=5)
    kw = dict(n_vq=N_VQ, max_slots=MAX_SLOTS, max_chunk_frames=MAX_CHUNK, graphs_eager=True)
    one = CodecRunner(model, **kw)
    one.call_cost = CallCost(fixed_ms=0.0)  # a replay per length: several per dispatch
    planned, spread_out = [], []
    want = play(one, calls, planned)
    runner = CodecRunner(model, **kw, decode_lanes=3)
    runner.call_cost = CallCost(fixed_ms=0.0)
    assert len(runner.lanes) == 3 and runner.graphs is runner.lanes[0]
    assert len({id(lane.decoder) for lane in runner.lanes}) == 1  # one decoder state, three graph sets
    got = play(runner, calls, spread_out)
    # dispatches of fewer calls than lanes were split: more calls, the same rows at the same lengths
    assert any(len(b) > len(a) for a, b in zip(planned, spread_out))
    for a, b in zip(planned, spread_out):
        assert {T: sum(n for n, t in a if t == T) for _, T in a} == {T: sum(n for n, t in b if t == T) for _, T in b}
    assert all(lane.keys for lane in runner.lanes)  # every lane replayed something
    for rid in want:
        scale = max(1.0, float(np.abs(want[rid]).max()))
        assert np.abs(got[rid] - want[rid]).max() <= 1e-5 * scale, rid
    assert runner.capture((1, 6), (1, 15)) > 0 and all(
        {(1, 1), (6, 15)} <= set(lane.keys) for lane in runner.lanes)  # captured on every lane
    with pytest.raises(ValueError, match="decode_lanes"):
        CodecRunner(model, **kw, decode_lanes=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_decode_lanes_replay_side_by_side_equal_one_lane():
    """Replays of one dispatch on two CUDA streams at once (graphs, pools and capture streams of
    their own, the decoder's rings shared by disjoint slots) give every stream one lane's PCM, up
    to the rounding of other batch buckets where a dispatch was split across the lanes."""
    model = tiny_model("cuda")
    calls = script(seed=6)
    kw = dict(n_vq=N_VQ, max_slots=MAX_SLOTS, max_chunk_frames=MAX_CHUNK, cuda_graphs=True)
    one = CodecRunner(model, **kw)
    one.call_cost = CallCost(fixed_ms=0.0)
    one.capture(range(1, MAX_SLOTS + 1), (1, 2, 4, 15))
    want = play(one, calls)
    runner = CodecRunner(model, **kw, decode_lanes=2)
    runner.call_cost = CallCost(fixed_ms=0.0)
    runner.capture(range(1, MAX_SLOTS + 1), (1, 2, 4, 15))
    got = play(runner, calls)
    assert all(e.graph is not None for lane in runner.lanes for e in lane._entries.values())
    # recorded on a stream each: graphs of one capture stream share its cuBLAS workspace
    assert len({lane.capture_stream.cuda_stream for lane in runner.lanes}) == 2
    # split calls: other batch buckets, other GEMM tiles, and the decoder's state carries each
    # rounding into the later samples of the stream (on an H200: at most 3.6e-4 of the peak, at a
    # stream's end); a race between the lanes would be off by O(1)
    for rid in want:
        scale = max(1.0, float(np.abs(want[rid]).max()))
        assert np.abs(got[rid] - want[rid]).max() <= 2e-3 * scale, rid


def test_last_calls_names_each_replay_of_a_decode():
    """`last_calls`: (rows, frames) of every model call the last decode made (the timeline's
    replays per dispatch): planned replays hold every chunk once; a chunk longer than the graphs
    goes in graph-sized pieces."""
    runner = CodecRunner(tiny_model(), n_vq=N_VQ, max_slots=MAX_SLOTS, max_chunk_frames=MAX_CHUNK, graphs_eager=True)
    runner.call_cost = CallCost(fixed_ms=0.0)  # a replay per length
    rng = np.random.default_rng(7)
    for rid in (1, 2, 3, 4):
        runner.open(rid)
    lengths = {1: 1, 2: 1, 3: 4, 4: 20}
    runner.decode([(rid, rng.integers(0, 1024, (n, N_VQ), dtype=np.int64)) for rid, n in lengths.items()])
    assert sorted(runner.last_calls) == [(1, 4), (1, 5), (1, 15), (2, 1)]
