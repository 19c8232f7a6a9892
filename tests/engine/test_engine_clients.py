"""Several clients: a spawned API-like process connects with a picklable `ClientSpec`, gets the
same audio as the in-process client, and its death (SIGKILL) releases everything it held.
Shutdown: drain lets running requests finish; abort ends them with `EngineFailed`."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import shutil
import signal

import numpy as np
import pytest
import pytest_asyncio

from engine.client import EngineClient, EngineFailed
from engine.launcher import launch
from ipc.shm import list_segments
from profiles import load_profile
from speech.job import SpeechJob
from tests.engine.conftest import collect, joined, settle


def _api_process(spec, seed: int, frames: int, out) -> None:
    """A stand-in API process: connect, run one request, hand the PCM back."""

    async def go() -> np.ndarray:
        client = EngineClient.connect(spec)
        try:
            chunks = await collect(client, SpeechJob(text="from another process",
                                                     forced_frames=frames,
                                                     sampling={"seed": seed}))
            return joined(chunks)
        finally:
            await client.close()

    out.put(asyncio.run(go()))


def _api_process_without_its_tokenizer(spec, frames: int, out) -> None:
    """Connect, then lose the checkpoint's tokenizer files, then run one request: it is served
    only if connecting read everything the request path reads (nothing left for the first request)."""

    async def go() -> int:
        client = EngineClient.connect(spec)
        try:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                os.remove(os.path.join(spec.model_dir, name))
            chunks = await collect(client, SpeechJob(text="tokenizer read at start-up",
                                                     forced_frames=frames, sampling={"seed": 3}))
            return len(joined(chunks))
        finally:
            await client.close()

    try:
        out.put(asyncio.run(go()))
    except Exception as exc:  # handed back, so the test says what failed
        out.put(f"{type(exc).__name__}: {exc}")


def _api_process_that_hangs(spec, started) -> None:
    async def go() -> None:
        client = EngineClient.connect(spec)
        gen = client.generate(SpeechJob(text="never finished", forced_frames=3000,
                                        sampling={"seed": 1}))
        await gen.__anext__()
        started.set()
        await asyncio.sleep(3600)

    asyncio.run(go())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(demo_model_dir):
    handle = await launch(load_profile("cpu"), demo_model_dir, clients=5)
    instance = handle.instance
    try:
        yield handle
    finally:
        await handle.stop()
        assert list_segments(instance) == []


@pytest.mark.asyncio(loop_scope="module")
async def test_spawned_client_gets_the_same_audio(engine) -> None:
    local = engine.client(0)
    expected = joined(await collect(local, SpeechJob(text="from another process",
                                                     forced_frames=20, sampling={"seed": 7})))
    out = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_api_process,
                                           args=(engine.client_spec(1), 7, 20, out))
    proc.start()
    got = await asyncio.to_thread(out.get, True, 60)
    await asyncio.to_thread(proc.join, 10)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.asyncio(loop_scope="module")
async def test_connecting_reads_what_the_first_request_needs(engine, tmp_path) -> None:
    """An API process reads the tokenizer when it connects, not on its first request (which paid
    0.1-0.2 s of first audio for it, once in every API process)."""
    model_dir = tmp_path / "model"  # the checkpoint's description: everything but the weights
    shutil.copytree(engine.model_dir, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    spec = dataclasses.replace(engine.client_spec(4), model_dir=str(model_dir))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_api_process_without_its_tokenizer, args=(spec, 6, out))
    proc.start()
    got = await asyncio.to_thread(out.get, True, 60)
    await asyncio.to_thread(proc.join, 10)
    assert got == 6 * engine.variant.samples_per_frame, got


@pytest.mark.asyncio(loop_scope="module")
async def test_sigkill_of_an_api_process_releases_its_requests(engine) -> None:
    ctx = mp.get_context("spawn")
    local = engine.client(0)
    started = ctx.Event()
    hung = ctx.Process(target=_api_process_that_hangs, args=(engine.client_spec(2), started))
    hung.start()
    assert await asyncio.to_thread(started.wait, 60)
    assert local.counters()["running"] >= 1
    os.kill(hung.pid, signal.SIGKILL)
    await asyncio.to_thread(hung.join, 10)
    snap = await settle(local)
    assert snap["running"] == 0 and snap["codec_slots"] == 0, snap
    assert local.healthy()  # an API process dying is not an engine failure


@pytest.mark.asyncio(loop_scope="module")
async def test_a_client_closing_mid_stream_leaves_the_engine_serving(engine) -> None:
    leaving, staying = engine.client(3), engine.client(0)
    gens = [leaving.generate(SpeechJob(text="bye", forced_frames=400, sampling={"seed": i}))
            for i in range(2)]
    for gen in gens:
        await gen.__anext__()
    await leaving.close()  # its rings close while the codec may still write to them
    snap = await settle(staying)
    assert snap["running"] == 0 and snap["codec_slots"] == 0, snap
    assert staying.healthy()
    chunks = await collect(staying, SpeechJob(text="still here", forced_frames=3))
    assert chunks[-1].finish_reason == "stop"


async def test_closing_a_client_delivers_what_its_rings_already_hold(demo_model_dir) -> None:
    """The engine finished a request and its last chunks sit in the client's rings, unread (its
    readers had no turn of the loop): closing the client delivers them, so the request ends
    normally instead of failing. (Under load a drained shutdown met this race.)"""
    import time

    handle = await launch(load_profile("cpu"), demo_model_dir)
    try:
        client = handle.client(0)
        frames = 8  # a few chunks: done well within the blocked loop's 3 s, even on a loaded machine
        started = asyncio.Event()

        async def consume() -> list:
            chunks = []
            async for chunk in client.generate(SpeechJob(text="z", forced_frames=frames, sampling={"seed": 1})):
                chunks.append(chunk)
                started.set()
            return chunks

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 60)
        time.sleep(3.0)  # the loop blocked: the workers finish and write every chunk to the rings
        await client.close()  # the readers are cancelled before they ever run again
        chunks = await task
        assert chunks[-1].final
        assert len(joined(chunks)) == frames * handle.variant.samples_per_frame
    finally:
        await handle.stop()


@pytest.mark.parametrize("mode", ["drain", "abort"])
async def test_shutdown_drains_or_aborts(demo_model_dir, mode) -> None:
    handle = await launch(load_profile("cpu", [f"engine.shutdown={mode}"]), demo_model_dir)
    client = handle.client(0)
    frames = 24
    started = [asyncio.Event() for _ in range(3)]

    async def collect_started(job: SpeechJob, event: asyncio.Event) -> list:
        chunks = []
        async for chunk in client.generate(job):
            chunks.append(chunk)
            event.set()
        return chunks

    tasks = [asyncio.create_task(collect_started(SpeechJob(text="z", forced_frames=frames, sampling={"seed": i}),
                                                 started[i]))
             for i in range(3)]
    # every request streaming (the engine's chunk count can reach 3 while one is still queued)
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    await handle.stop()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    if mode == "drain":
        assert all(len(joined(r)) == frames * handle.variant.samples_per_frame for r in results)
    else:
        assert all(isinstance(r, EngineFailed) for r in results), results
