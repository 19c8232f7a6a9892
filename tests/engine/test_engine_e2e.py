"""The engine end to end on the tiny demo model: real talker and codec processes, real rings.

One engine serves the whole module (start-up is the expensive part). Its profile makes every
policy observable: a ramp (2, 4) before steady 15-frame chunks, a coalescing target of 4 streams
with a 100 ms window, capacity 8 running + 8 queued.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import pytest_asyncio

from engine.client import EngineFailed, EngineRejected
from engine.launcher import launch
from ipc.shm import list_segments
from profiles import load_profile
from speech.job import SpeechJob
from tests.engine.conftest import collect, joined, settle

pytestmark = pytest.mark.asyncio(loop_scope="module")

OVERRIDES = [
    "chunking.ramp=[2, 4]", "chunking.chunk_frames=15",
    "coalescing.min_batch=4", "coalescing.max_wait_ms=100", "coalescing.max_batch=8",
    "admission.max_running=8", "admission.max_queued=8",
    "talker.max_running=8", "codec.max_slots=8",
]
MAX_WAIT_S = 0.100


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(demo_model_dir):
    handle = await launch(load_profile("cpu", OVERRIDES), demo_model_dir, clients=1)
    instance = handle.instance
    try:
        yield handle
    finally:
        await handle.stop()
        assert list_segments(instance) == [], "shared-memory segments left after stop"


@pytest.fixture(scope="module")
def direct(engine):
    """The same model run in this process without workers (`stages.synth_direct`)."""
    from stages.synth_direct import DirectSynthesizer

    return DirectSynthesizer(engine.model_dir, engine.profile)


@pytest.fixture
def client(engine):
    return engine.client(0)


def frames_of(chunks, samples_per_frame: int) -> list[int]:
    return [len(c.pcm) // samples_per_frame for c in chunks]


async def test_chunks_follow_the_policy(engine, client) -> None:
    spf = engine.variant.samples_per_frame
    chunks = await collect(client, SpeechJob(text="a", forced_frames=1 + 2 + 4 + 15 + 5,
                                             sampling={"seed": 1}))
    assert frames_of(chunks, spf) == [1, 2, 4, 15, 5]
    assert [c.final for c in chunks] == [False] * 4 + [True]
    assert chunks[-1].finish_reason == "stop"
    # an exact multiple ends with the empty terminal record
    chunks = await collect(client, SpeechJob(text="a", forced_frames=1 + 2 + 4 + 15,
                                             sampling={"seed": 1}))
    assert frames_of(chunks, spf) == [1, 2, 4, 15, 0]
    assert chunks[-1].final and chunks[-1].pcm.shape == (0, engine.variant.channels)
    # a per-request first chunk
    chunks = await collect(client, SpeechJob(text="a", forced_frames=12, initial_chunk_frames=5,
                                             sampling={"seed": 1}))
    assert frames_of(chunks, spf)[:3] == [5, 2, 4]


async def test_streaming_equals_whole_decode(engine, client) -> None:
    job = dict(text="streaming equals whole", forced_frames=30, sampling={"seed": 11})
    streamed = await collect(client, SpeechJob(**job))
    whole = await collect(client, SpeechJob(**job, initial_chunk_frames=30))
    assert len(streamed) > 3 and len([c for c in whole if len(c.pcm)]) == 1
    a, b = joined(streamed), joined(whole)
    assert a.shape == b.shape == (30 * engine.variant.samples_per_frame, engine.variant.channels)
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    assert np.abs(a).max() > 0  # real audio, not silence


@pytest.mark.parametrize("mode", ["plain", "clone", "continuation"])
async def test_engine_equals_direct_synthesis(engine, client, direct, mode) -> None:
    """Same seed, same request: the engine's audio equals `stages.synth_direct` (no processes)."""
    from stages.synth_direct import reference_codes

    rng = np.random.default_rng(5)
    rate = engine.variant.sample_rate
    ref_wav = (rng.standard_normal((engine.variant.channels, rate)) * 0.1).astype(np.float32)
    ref_audio = None if mode == "plain" else (ref_wav, rate)
    ref_text = "the reference says this. " if mode == "continuation" else None
    text = "compare the engine with the direct path"
    expected, stats = direct.synthesize(text, ref_audio=ref_audio, ref_text=ref_text, seed=21)
    codes = None if ref_audio is None else reference_codes(direct.codec, ref_audio)
    got = joined(await collect(client, SpeechJob(text=text, ref_codes=codes, ref_text=ref_text,
                                                 sampling={"seed": 21})))
    assert got.shape == expected.T.shape and stats.frames > 0
    np.testing.assert_allclose(got, expected.T, atol=1e-4, rtol=0)


async def test_echoed_codes_are_the_ones_the_audio_was_decoded_from(engine, client, direct) -> None:
    job = dict(text="echo", forced_frames=1 + 2 + 4 + 15 + 3, sampling={"seed": 4})
    echoed = [c async for c in client.generate(SpeechJob(**job), echo_codes=True)]
    spf = engine.variant.samples_per_frame
    assert [len(c.codes) for c in echoed if c.codes is not None] == [1, 2, 4, 15, 3]
    assert [len(c.codes) for c in echoed if c.codes is not None] == [n for n in frames_of(echoed, spf) if n]
    codes = np.concatenate([c.codes for c in echoed if c.codes is not None])  # [25, n_vq]
    direct.codec.open(-9)
    try:
        pcm = direct.codec.decode([(-9, codes)])[0]  # [channels, samples]
    finally:
        direct.codec.close(-9)
    np.testing.assert_allclose(joined(echoed), pcm.T, atol=1e-4, rtol=0)
    assert all(c.codes is None for c in await collect(client, SpeechJob(**job)))  # only when asked


async def test_a_prompt_beyond_the_kv_cache_is_refused_before_it_is_sent(engine, client) -> None:
    kv_tokens = engine.profile.talker.kv_blocks * engine.profile.talker.kv_block_size
    text = "many words here " * (kv_tokens // 3)
    with pytest.raises(ValueError, match=f"KV cache holds at most {kv_tokens - 1} rows"):
        await asyncio.wait_for(collect(client, SpeechJob(text=text, forced_frames=2)), 60)
    chunks = await collect(client, SpeechJob(text="fine", forced_frames=2, sampling={"seed": 1}))
    assert chunks[-1].finish_reason == "stop"


async def test_runaway_guard_finishes_with_length(engine, client) -> None:
    chunks = await collect(client, SpeechJob(text="h", forced_frames=50,
                                             sampling={"seed": 2, "max_new_frames": 9}))
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.pcm) for c in chunks) == 9 * engine.variant.samples_per_frame


async def test_sixteen_concurrent_requests_match_their_solo_runs(engine, client) -> None:
    rng = np.random.default_rng(0)
    wav = rng.standard_normal((engine.variant.channels, 3 * engine.variant.samples_per_frame))
    ref = await client.encode_reference(wav.astype(np.float32) * 0.1)
    assert ref.shape == (3, engine.variant.n_vq) and ref.dtype == np.int64
    jobs = []
    for i in range(16):
        jobs.append(dict(text=f"request number {i} " + "la" * i, forced_frames=8 + i,
                         sampling={"seed": 100 + i, "top_k": 5 + i},
                         ref_codes=ref if i % 3 == 1 else None,
                         ref_text="a reference. " if i % 6 == 1 else None))
    together = await asyncio.gather(*(collect(client, SpeechJob(**j)) for j in jobs))
    for job, chunks in zip(jobs, together):
        alone = await collect(client, SpeechJob(**job))
        np.testing.assert_allclose(joined(chunks), joined(alone), atol=1e-4, rtol=0)
    distinct = {joined(c)[:200].tobytes() for c in together}
    assert len(distinct) == 16


async def test_coalescing_batches_four_streams_and_never_holds_one(client) -> None:
    jobs = [SpeechJob(text="b", forced_frames=1 + 2 + 4 + 15 + 15, sampling={"seed": s})
            for s in range(4)]
    results = await asyncio.gather(*(collect(client, j) for j in jobs))
    sizes = [c.batch_size for chunks in results for c in chunks]
    assert 4 in sizes, f"no decode batch of 4 streams: {sizes}"
    alone = await collect(client, SpeechJob(text="c", forced_frames=40, sampling={"seed": 9}))
    waits = [c.coalesce_wait_s for c in alone if c.batch_size]
    # idle_wait: a lone stream cannot be joined, so it never waits for the window
    assert max(waits) < MAX_WAIT_S, waits
    snap = client.counters()
    assert snap["decode_batch_sizes"].get(4, 0) >= 1
    assert snap["talker_batch_sizes"].get(4, 0) >= 1  # the talker stepped the four together


async def test_admission_rejects_beyond_capacity(client) -> None:
    # capacity = 8 running + 8 queued; offer twice that at once
    async def one(i: int):
        try:
            chunks = await collect(client, SpeechJob(text="d", forced_frames=6,
                                                     sampling={"seed": i}))
            return chunks
        except EngineRejected as exc:
            return exc

    results = await asyncio.gather(*(one(i) for i in range(32)))
    rejected = [r for r in results if isinstance(r, EngineRejected)]
    served = [r for r in results if not isinstance(r, EngineRejected)]
    assert len(rejected) >= 8, f"only {len(rejected)} of 32 rejected"
    assert all(r.retry_after_s > 0 and "queue full" in r.reason for r in rejected)
    assert all(chunks[-1].final and len(joined(chunks)) == 6 * 3840 for chunks in served)
    snap = await settle(client)
    assert snap["rejected"] >= len(rejected) and snap["queued"] == 0


async def test_cancel_200_requests_at_random_points_leaks_nothing(client) -> None:
    rng = random.Random(4)

    async def cancel_after(i: int) -> None:
        job = SpeechJob(text="e", forced_frames=rng.randint(1, 25), sampling={"seed": i})
        stop_after = rng.randint(0, 3)
        gen = client.generate(job)
        try:
            seen = 0
            async for _ in gen:
                if seen >= stop_after:
                    break
                seen += 1
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.random() * 0.02)
        except EngineRejected:
            pass
        finally:
            await gen.aclose()

    async def cancel_by_task(i: int) -> None:
        task = asyncio.create_task(collect(client, SpeechJob(text="f", forced_frames=20,
                                                             sampling={"seed": i})))
        await asyncio.sleep(rng.random() * 0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    for wave in range(200 // 16 + 1):
        n = min(16, 200 - wave * 16)
        await asyncio.gather(*(cancel_after(wave * 16 + i) if i % 2 else
                               cancel_by_task(wave * 16 + i) for i in range(n)))
    snap = await settle(client)
    for gauge in ("running", "queued", "talker_slots", "codec_slots", "encode_jobs",
                  "ring_bytes", "client_ring_bytes", "client_open"):
        assert snap[gauge] == 0, (gauge, snap)
    assert snap["aborted"] >= 100
    # the engine still serves normally afterwards
    chunks = await collect(client, SpeechJob(text="g", forced_frames=3, sampling={"seed": 1}))
    assert chunks[-1].final and chunks[-1].finish_reason == "stop"


async def test_a_started_request_runs_before_it_is_read_and_closed_unread_leaves_nothing(client) -> None:
    """`start` submits at once: the engine serves the request while nobody reads it yet, and its
    chunks are all there when they are read. Closed without a single read, it is aborted and
    every gauge returns to zero."""
    job = SpeechJob(text="h", forced_frames=1 + 2 + 4, sampling={"seed": 5})
    expected = joined(await collect(client, job))
    before = await settle(client)
    chunks = client.start(job)
    deadline = asyncio.get_running_loop().time() + 10
    while client.counters()["finished_stop"] == before["finished_stop"]:  # served, unread
        assert asyncio.get_running_loop().time() < deadline, "the unread request never ran"
        await asyncio.sleep(0.02)
    assert client.counters()["submitted"] == before["submitted"] + 1
    np.testing.assert_array_equal(joined([c async for c in chunks]), expected)

    aborted = client.counters()["aborted"]
    unread = client.start(SpeechJob(text="i", forced_frames=3000, sampling={"seed": 6}))
    await asyncio.sleep(0.2)
    await unread.aclose()
    snap = await settle(client)
    assert all(snap[gauge] == 0 for gauge in ("running", "queued", "talker_slots", "codec_slots",
                                              "client_ring_bytes", "client_open")), snap
    assert snap["aborted"] == aborted + 1
    assert [c async for c in unread] == []  # closed: nothing more to read


async def test_longest_accepted_reference_encodes(engine, client) -> None:
    """A reference of `api.max_ref_seconds` fits the reference rings and encodes on the codec."""
    seconds = engine.profile.api.max_ref_seconds
    rate, channels = engine.variant.sample_rate, engine.variant.channels
    wav = np.random.default_rng(1).standard_normal((channels, int(seconds * rate)))
    codes = await client.encode_reference((wav * 0.05).astype(np.float32))
    assert codes.shape == (int(seconds * rate) // engine.variant.samples_per_frame,
                           engine.variant.n_vq)
    with pytest.raises(ValueError, match="reference waveform"):
        await client.encode_reference(np.zeros((channels + 1, rate), np.float32))


async def test_synth_command_goes_through_the_engine(engine, direct, tmp_path, caplog) -> None:
    """`mossvox synth` (engine by default: worker processes) writes what the direct path makes."""
    import logging

    import soundfile as sf

    from api.audio_encoding import float_to_s16le

    caplog.set_level(logging.INFO, logger="mossvox.synth")
    caplog.set_level(logging.INFO, logger="engine.coordinator")
    from cli.main import main as cli

    out = tmp_path / "out.wav"
    text = "the synth command through the engine"
    argv = ["synth", text, "--model", str(engine.model_dir), "--seed", "8", "-o", str(out)]
    assert await asyncio.to_thread(cli, argv) == 0   # its own event loop, in a thread
    assert "through the engine" in caplog.text
    assert "went away" not in caplog.text  # its client closing with nothing open is no news
    got, rate = sf.read(str(out), dtype="int16")  # a 16-bit WAV, as the server writes
    expected, _ = direct.synthesize(text, seed=8)
    assert rate == engine.variant.sample_rate
    want = np.frombuffer(float_to_s16le(expected.T), dtype=np.int16).reshape(got.shape)
    assert np.abs(got.astype(np.int32) - want).max() <= 4  # 1e-4 of float difference, in 16-bit steps
