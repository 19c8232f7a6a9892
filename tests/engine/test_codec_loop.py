"""The codec worker's loop driven in-process: real codec runner (tiny demo codec), real channels.

Covers the paths an end-to-end run cannot hit on purpose: an abort that finds the stream's final
record already queued, an API process whose ring is closed or stays full (its streams fail; the
codec keeps serving the others)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ipc.channel import Channel
from ipc.messages import (Abort, ChunkDone, ClientInbox, CodecInbox, CodeChunk, CoordinatorInbox,
                          DecodeBatch, EncodeRequest, EncodeResult, PcmChunk, StageError)
from ipc.shm import new_instance_id
from profiles import load_profile
from stages.registry import load_variant
from stages.runtime.coalescer import Coalescer
from stages.workers.encoder_thread import EncoderThread
from stages.workers.codec import CodecLoop


class Rig:
    """A CodecLoop wired to channels whose other ends this test holds."""

    def __init__(self, model_dir, clients: int = 2, client_ring: int = 1 << 20,
                 coalescer: Coalescer | None = None, express: bool = False, **loop_options) -> None:
        variant = load_variant(model_dir, load_profile("cpu"))
        self.runner = variant.make_codec_runner("cpu")
        self.n_vq = variant.n_vq
        inst = new_instance_id()

        def pair(name, msg_type, capacity=1 << 20):
            w = Channel.create(name, msg_type=msg_type, capacity=capacity, role="writer",
                               instance=inst)
            return w, w.spec().open()

        self.talker, talker_r = pair("t", CodecInbox)
        self.coord, coord_r = pair("c", CodecInbox)
        to_coord, self.events = pair("e", CoordinatorInbox)
        outs = [pair(f"o{i}", ClientInbox, client_ring) for i in range(clients)]
        self.client_rx = [r for _, r in outs]
        self.loop = CodecLoop(self.runner, talker_r, coord_r, to_coord, [w for w, _ in outs],
                              coalescer or Coalescer(), encode_batch=4, client_stall_s=0.2,
                              express_first_chunks=express, **loop_options)
        self._all = [self.talker, talker_r, self.coord, coord_r, to_coord, self.events,
                     *[c for pair_ in outs for c in pair_]]

    def chunk(self, rid: int, client: int, seq: int, frames: int, final: bool = False,
              reason: str | None = None) -> None:
        codes = np.full((frames, self.n_vq), seq % 7, dtype=np.int64)
        self.talker.send(CodeChunk(rid=rid, client=client, seq=seq, final=final,
                                   finish_reason=reason), codes)

    def drain_events(self) -> list:
        out = []
        while (rec := self.events.try_recv()) is not None:
            out.append(rec.msg)
            rec.release()
        return out

    def close(self) -> None:
        self.loop.encoder.close()
        for ch in self._all:
            ch.close()


@pytest.fixture
def rig(demo_model_dir):
    r = Rig(demo_model_dir)
    yield r
    r.close()


def test_abort_finds_the_final_record_already_queued(rig) -> None:
    rig.chunk(1, 0, 0, 1)
    rig.chunk(1, 0, 1, 2, final=True, reason="stop")
    rig.loop.step()                      # decodes the first chunk; the final one waits its turn
    assert len(rig.loop.streams[1].waiting) == 1
    rig.coord.send(Abort(rid=1))
    rig.loop.step()
    done = [m for m in rig.drain_events() if isinstance(m, ChunkDone) and m.final]
    assert [(d.rid, d.finish_reason) for d in done] == [(1, "abort")]
    assert rig.loop.streams == {} and rig.runner.num_open() == 0


@pytest.mark.parametrize("express", [True, False])
def test_first_chunks_skip_the_coalescing_window(demo_model_dir, express) -> None:
    """With express first chunks, a request's first chunk is decoded at once, alone, while a
    later chunk of another request keeps waiting for the window (4 streams or 10 s here)."""
    window = Coalescer(min_batch=4, max_wait_s=10.0, max_batch=8, policy="fixed")
    rig = Rig(demo_model_dir, coalescer=window, express=express)
    try:
        rig.chunk(1, 0, 1, 2)  # request 1's second chunk (its first was decoded earlier)
        rig.chunk(2, 0, 0, 1)  # request 2's first chunk
        rig.loop.step()
        batches = [m for m in rig.drain_events() if isinstance(m, DecodeBatch)]
        if express:
            assert [b.size for b in batches] == [1]
            rec = rig.client_rx[0].try_recv()
            assert (rec.msg.rid, rec.msg.seq) == (2, 0)
            rec.release()
        else:
            assert batches == []
        assert len(rig.loop.streams[1].waiting) == 1  # the later chunk still waits for the window
    finally:
        rig.close()


@pytest.mark.parametrize("due", [True, False])
def test_express_first_chunks_join_the_batch_due_at_the_same_moment(demo_model_dir, due) -> None:
    """With `express_joins_dispatch`, first chunks go in the batch due now (one decode call, not
    two); with no batch due they still go at once, alone, and the others keep waiting."""
    window = Coalescer(min_batch=2, max_wait_s=10.0, max_batch=8, policy="fixed")
    rig = Rig(demo_model_dir, coalescer=window, express=True, express_joins_dispatch=True)
    try:
        rig.chunk(1, 0, 1, 2)  # request 1's second chunk
        if due:
            rig.chunk(3, 1, 1, 2)  # and request 3's: two ready, the window's batch is due
        rig.chunk(2, 0, 0, 1)  # request 2's first chunk
        rig.loop.step()
        batches = [m for m in rig.drain_events() if isinstance(m, DecodeBatch)]
        assert [b.size for b in batches] == ([3] if due else [1])
        got = []
        while (rec := rig.client_rx[0].try_recv()) is not None:
            got.append((rec.msg.rid, rec.msg.seq))
            rec.release()
        assert sorted(got) == ([(1, 1), (2, 0)] if due else [(2, 0)])
        assert len(rig.loop.streams[1].waiting) == (0 if due else 1)
    finally:
        rig.close()


@pytest.mark.parametrize("patient_wait_s", [0.3, 0.0])
def test_a_steady_chunk_of_a_buffered_stream_waits_for_a_larger_dispatch(demo_model_dir, patient_wait_s):
    """With patience, a steady chunk whose client holds over a second of audio waits past the
    window's 10 ms (up to patient_wait_s) for other streams; a chunk of a stream with little
    audio buffered (the second chunk here) and every chunk without patience keep the window."""
    now = [100.0]
    window = Coalescer(min_batch=8, max_wait_s=0.010, max_batch=8, policy="fixed")
    rig = Rig(demo_model_dir, coalescer=window, express=True, clock=lambda: now[0],
              patient_wait_s=patient_wait_s, buffer_margin_s=0.2)
    try:
        def batches() -> list[int]:
            return [m.size for m in rig.drain_events() if isinstance(m, DecodeBatch)]

        rig.chunk(1, 0, 0, 1)
        rig.loop.step()  # the first chunk: express, 0.08 s of audio out
        rig.chunk(1, 0, 1, 15)
        rig.loop.step()  # little audio buffered: it waits the window's 10 ms ...
        now[0] += 0.011
        rig.loop.step()  # ... and is decoded: 1.28 s out
        assert batches() == [1, 1]
        rig.chunk(1, 0, 2, 15)
        rig.loop.step()
        now[0] += 0.011
        rig.loop.step()  # 1.2 s buffered: with patience it waits on, else the window has passed
        assert batches() == ([] if patient_wait_s else [1])
        if patient_wait_s:
            now[0] += patient_wait_s
            rig.loop.step()
            assert batches() == [1]
        assert rig.loop.streams[1].audio_out_s == pytest.approx(31 * 0.08)
    finally:
        rig.close()


@pytest.mark.parametrize("final_wait_s", [0.0, None])
def test_a_final_chunk_with_no_wait_dispatches_at_once(demo_model_dir, final_wait_s):
    """With `final_wait_s` 0 a request's final chunk (its last audio) goes in the next step with
    the other ready chunks, not after the window; without it, it waits the window like any other,
    and a steady chunk waits the window either way."""
    now = [100.0]
    window = Coalescer(min_batch=8, max_wait_s=0.010, max_batch=8, policy="fixed")
    rig = Rig(demo_model_dir, coalescer=window, express=True, clock=lambda: now[0],
              final_wait_s=final_wait_s)
    try:
        def batches() -> list[int]:
            return [m.size for m in rig.drain_events() if isinstance(m, DecodeBatch)]

        rig.chunk(1, 0, 0, 1)
        rig.chunk(2, 0, 0, 1)
        rig.loop.step()  # both first chunks: express
        assert batches() == [2]
        rig.chunk(2, 0, 1, 4)
        rig.loop.step()  # a steady chunk alone waits the window
        assert batches() == []
        rig.chunk(1, 0, 1, 3, final=True, reason="stop")
        rig.loop.step()  # the final chunk: due at once takes the waiting steady chunk with it
        assert batches() == ([2] if final_wait_s == 0.0 else [])
        if final_wait_s is None:  # (with nothing left ready, a step would sleep until a record)
            now[0] += 0.011
            rig.loop.step()
            assert batches() == [2]
        assert 1 not in rig.loop.streams  # its final audio went out: the stream is closed
    finally:
        rig.close()


def _client_records(rig, client: int = 0) -> list:
    out = []
    while (rec := rig.client_rx[client].try_recv()) is not None:
        out.append(rec.msg)
        rec.release()
    return out


def _step_until(rig, done, limit_s: float = 20.0) -> list:
    """Step the loop until `done(records so far)`; the client 0 records seen."""
    seen, deadline = [], time.monotonic() + limit_s
    while not done(seen):
        assert time.monotonic() < deadline, f"not done after {limit_s} s: {seen}"
        rig.loop.step()
        seen += _client_records(rig)
    return seen


def test_a_waiting_reference_encode_goes_after_the_audio_that_is_due(demo_model_dir) -> None:
    """A first chunk and a reference-encode job arrive together: the chunk's audio is written to
    its client before the encode's codes (an encode batch must not delay first audio)."""
    rig = Rig(demo_model_dir, express=True)
    try:
        wav = np.zeros((rig.runner.channels, 2 * rig.runner.samples_per_frame), dtype=np.float32)
        rig.coord.send(EncodeRequest(job=5, client=0), wav)
        rig.chunk(1, 0, 0, 1)
        seen = _step_until(rig, lambda got: any(isinstance(m, EncodeResult) for m in got))
        assert [type(m) for m in seen] == [PcmChunk, EncodeResult]
    finally:
        rig.close()


def test_an_encode_in_flight_never_holds_up_decoding(demo_model_dir) -> None:
    """The encoder thread is stuck on a batch: streams keep decoding chunk after chunk; once the
    batch is done its codes go out and the jobs that waited meanwhile go as the next batch."""
    release, started = threading.Event(), threading.Event()
    rig = Rig(demo_model_dir, express=True)
    runner = rig.runner
    sizes = []

    def slow_encode(wavs):
        sizes.append(len(wavs))
        started.set()
        release.wait(30)
        return runner.encode(wavs)

    rig.loop.encoder = EncoderThread(slow_encode, "cpu")
    try:
        wav = np.zeros((runner.channels, 2 * runner.samples_per_frame), dtype=np.float32)
        rig.coord.send(EncodeRequest(job=0, client=0), wav)
        rig.loop.step()
        assert started.wait(10) and sizes == [1]  # the first batch is stuck in the thread
        for job in (1, 2, 3):
            rig.coord.send(EncodeRequest(job=job, client=0), wav)
        for seq in range(4):
            rig.chunk(1, 0, seq, 1)
        seen = _step_until(rig, lambda got: sum(isinstance(m, PcmChunk) for m in got) == 4)
        assert not any(isinstance(m, EncodeResult) for m in seen)
        assert sizes == [1] and rig.loop.encoder.in_flight == 1 and len(rig.loop.encodes) == 3
        release.set()
        seen = _step_until(rig, lambda got: sum(isinstance(m, EncodeResult) for m in got) == 4)
        assert [m.job for m in seen if isinstance(m, EncodeResult)] == [0, 1, 2, 3]
        assert all(m.error is None for m in seen if isinstance(m, EncodeResult))
        assert sizes == [1, 3]  # the three that waited went together
    finally:
        release.set()
        rig.close()


def test_encode_batches_shrink_while_streams_are_decoding(demo_model_dir) -> None:
    """With `encode_batch_streaming`, a batch holds at most that many reference clips while a
    stream is open (it shares the GPU with their decoding), and up to `encode_batch` (4) once none
    is."""
    rig = Rig(demo_model_dir, express=True, encode_batch_streaming=1)
    submitted = []
    submit = rig.loop.encoder.submit

    def spy(jobs, wavs, note=None):
        submitted.append((len(jobs), bool(rig.loop.streams)))
        submit(jobs, wavs, note)

    rig.loop.encoder.submit = spy
    try:
        wav = np.zeros((rig.runner.channels, 2 * rig.runner.samples_per_frame), dtype=np.float32)
        for job in range(6):
            rig.coord.send(EncodeRequest(job=job, client=0), wav)
        rig.chunk(1, 0, 0, 1)  # a stream opens with its first chunk
        _step_until(rig, lambda got: sum(isinstance(m, EncodeResult) for m in got) >= 2)
        assert submitted[:2] == [(1, True), (1, True)]
        rig.chunk(1, 0, 1, 1, final=True, reason="stop")
        seen = _step_until(rig, lambda got: rig.loop.streams == {} and not rig.loop.encodes
                           and not rig.loop.encoder.in_flight)
        assert all(n == 1 for n, open_ in submitted if open_)
        assert [n for n, open_ in submitted if not open_][0] > 1  # larger once no stream is open
        assert sum(n for n, _ in submitted) == 6
    finally:
        rig.close()


def test_a_closed_client_ring_fails_only_that_clients_streams(rig) -> None:
    rig.chunk(1, 0, 0, 1)
    rig.chunk(2, 1, 0, 1)
    rig.client_rx[1].close()             # API process 1 went away
    rig.loop.step()
    events = rig.drain_events()
    failed = [m.rid for m in events if isinstance(m, StageError)]
    assert failed == [2]
    rec = rig.client_rx[0].try_recv()    # client 0 still got its audio
    assert isinstance(rec.msg, PcmChunk) and rec.msg.rid == 1
    rec.release()
    rig.chunk(2, 1, 1, 0, final=True, reason="abort")  # the talker's final record after abort
    rig.chunk(1, 0, 1, 0, final=True, reason="stop")
    rig.loop.step()
    closed = {m.rid for m in rig.drain_events() if isinstance(m, ChunkDone) and m.final}
    assert closed == {1, 2} and rig.loop.streams == {}


def test_a_stalled_client_ring_times_out(demo_model_dir) -> None:
    rig = Rig(demo_model_dir, clients=1, client_ring=256 * 1024)  # holds ~8 one-frame chunks
    try:
        for seq in range(12):            # nobody reads client 0's ring
            rig.chunk(5, 0, seq, 1)
        rig.loop.step()
        while rig.loop.streams[5].waiting and not rig.loop.streams[5].aborted:
            rig.loop.step()
        assert rig.loop.streams[5].aborted
        assert [m.rid for m in rig.drain_events() if isinstance(m, StageError)] == [5]
    finally:
        rig.close()


def test_a_stalled_client_keeps_its_later_streams(demo_model_dir) -> None:
    """An overloaded API process (ring full past client_stall_s) loses the streams it had, not
    the requests it sends afterwards: once it reads again, a new stream is delivered."""
    rig = Rig(demo_model_dir, clients=1, client_ring=256 * 1024)
    try:
        for seq in range(12):
            rig.chunk(5, 0, seq, 1)
        rig.loop.step()
        while rig.loop.streams[5].waiting and not rig.loop.streams[5].aborted:
            rig.loop.step()
        assert rig.loop.streams[5].aborted
        while (rec := rig.client_rx[0].try_recv()) is not None:  # the process catches up
            rec.release()
        rig.chunk(6, 0, 0, 1)
        rig.loop.step()
        got = []
        while (rec := rig.client_rx[0].try_recv()) is not None:
            got.append(rec.msg)
            rec.release()
        assert any(getattr(m, "rid", None) == 6 for m in got)
        assert 6 not in {m.rid for m in rig.drain_events() if isinstance(m, StageError)}
    finally:
        rig.close()


def test_no_free_decode_slot_fails_the_request_not_the_worker(demo_model_dir) -> None:
    rig = Rig(demo_model_dir, clients=1)
    try:
        for rid in range(rig.runner.max_slots + 1):
            rig.chunk(rid, 0, 0, 1)
        rig.loop.step()
        failed = [m.rid for m in rig.drain_events() if isinstance(m, StageError)]
        assert len(failed) == 1 and rig.runner.num_open() == rig.runner.max_slots
        rig.chunk(failed[0], 0, 1, 0, final=True, reason="abort")
        rig.loop.step()
        assert failed[0] not in rig.loop.streams
    finally:
        rig.close()


def test_a_slow_dispatch_is_logged_with_the_triton_kernels_it_specialised(demo_model_dir, monkeypatch,
                                                                          caplog) -> None:
    """A dispatch over `SLOW_DISPATCH_S` goes to the log with its chunks, frames and the Triton
    kernels specialised inside it (a stand-in counter: one more at each read), and the stream
    still gets its audio; a quick dispatch logs nothing."""
    reads = iter(range(10**6))
    r = Rig(demo_model_dir, kernels=lambda: 3 * next(reads))  # each dispatch: reads 0, 3 -> 3 kernels
    try:
        r.chunk(1, 0, 0, 2)
        with caplog.at_level("WARNING", logger="stages.workers.codec"):
            # quick against a threshold it cannot reach (a first CPU dispatch on a loaded machine
            # can take longer than the served threshold)
            monkeypatch.setattr("stages.workers.codec.SLOW_DISPATCH_S", 60.0)
            r.loop.step()
            assert not [rec for rec in caplog.records if "dispatch" in rec.getMessage()]
            monkeypatch.setattr("stages.workers.codec.SLOW_DISPATCH_S", 0.0)
            r.chunk(1, 0, 1, 3, final=True, reason="stop")
            r.loop.step()
        slow = [rec.getMessage() for rec in caplog.records if "dispatch" in rec.getMessage()]
        assert len(slow) == 1 and "dispatch of 1 chunks (3 frames); it specialised 3 Triton kernel(s)" in slow[0]
        done = [m for m in r.drain_events() if isinstance(m, ChunkDone)]
        assert [(m.seq, m.final) for m in done] == [(0, False), (1, True)]
    finally:
        r.close()


def _encode_batches(rig: Rig, frames: tuple[int, ...]) -> list[list[int]]:
    """Encode jobs of clips of these many frames, sent at once: the frames of each batch the loop
    handed to its encoder thread, once every job's codes came back in order."""
    hop = rig.runner.samples_per_frame
    sizes = []
    submit = rig.loop.encoder.submit

    def spy(jobs, wavs, note=None):
        sizes.append([w.shape[1] // hop for w in wavs])
        submit(jobs, wavs, note)

    rig.loop.encoder.submit = spy
    for job, n in enumerate(frames):
        rig.coord.send(EncodeRequest(job=job, client=0), np.zeros((rig.runner.channels, n * hop), np.float32))
    seen = _step_until(rig, lambda got: sum(isinstance(m, EncodeResult) for m in got) == len(frames))
    assert [m.job for m in seen if isinstance(m, EncodeResult)] == list(range(len(frames)))
    return sizes


def test_with_encode_graphs_a_batch_stays_within_a_replayed_bucket(demo_model_dir) -> None:
    """Encode graphs of batches up to 4 in buckets of 4 and 8 frames, 16 frames' samples at most
    a bucket: clips of 2, 2, 2, 5 and 2 frames go as 2+2+2 (a replayed batch of 4 x 4 frames;
    the 5-frame clip would make it 4 x 8, past every graph) and then 5+2 (2 x 8), each replayed,
    instead of 2+2+2+5 eagerly and 2 alone."""
    from stages.models.codec.encode_graphs import EncodeGraphs

    rig = Rig(demo_model_dir)
    try:
        hop = rig.runner.samples_per_frame
        graphs = EncodeGraphs(rig.runner.model, n_vq=rig.n_vq, max_batch=4, capture=False, max_samples=16 * hop)
        graphs.lengths = [4 * hop, 8 * hop]
        rig.runner.encode_graphs = graphs
        assert _encode_batches(rig, (2, 2, 2, 5, 2)) == [[2, 2, 2], [5, 2]]
        assert sorted(graphs.keys) == [(2, 8 * hop), (4, 4 * hop)]  # both batches replayed
    finally:
        rig.close()


def test_an_encode_batch_holds_at_most_its_seconds_of_padded_clips(demo_model_dir) -> None:
    """`encode_batch_samples`: jobs join a batch in arrival order while the batch, every clip
    padded to its longest, stays within the bound; the first job of a batch always goes, even
    alone over it. Clips of 2, 2, 2, 5 and 2 frames under a bound of 6 frames' samples: 2+2+2
    (3 x 2 = 6), then 5 alone (2 x 5 > 6), then 2."""
    rig = Rig(demo_model_dir)
    try:
        hop = rig.runner.samples_per_frame
        rig.loop.encode_batch_samples = 6 * hop
        assert _encode_batches(rig, (2, 2, 2, 5, 2)) == [[2, 2, 2], [5], [2]]
    finally:
        rig.close()
