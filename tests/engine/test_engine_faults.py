"""A SIGKILLed worker: every in-flight request fails within 2 s, the engine says it is unhealthy,
and stopping it afterwards leaves no process and no shared-memory segment behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from engine.client import EngineFailed
from engine.coordinator import StageNotReady
from engine.launcher import launch
from ipc.shm import list_segments
from profiles import load_profile
from speech.job import SpeechJob
from tests.engine.conftest import collect, settle


async def wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("stage", ["talker", "codec"])
async def test_sigkill_of_a_worker_fails_everything_fast(demo_model_dir, stage) -> None:
    handle = await launch(load_profile("cpu"), demo_model_dir)
    instance, pids = handle.instance, dict(handle.pids)
    client = handle.client(0)
    try:
        tasks = [asyncio.create_task(collect(client, SpeechJob(text="long", forced_frames=3000,
                                                               sampling={"seed": i})))
                 for i in range(4)]
        await wait_for(lambda: client.counters()["chunks"] >= 4, 20)
        assert client.healthy()
        os.kill(pids[stage], signal.SIGKILL)
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        elapsed = time.monotonic() - t0
        assert all(isinstance(r, EngineFailed) for r in results), results
        assert elapsed < 2.0, f"requests took {elapsed:.2f} s to fail"
        assert not client.healthy()
        with pytest.raises(EngineFailed):
            await asyncio.wait_for(collect(client, SpeechJob(text="after", forced_frames=2)), 2)
    finally:
        await asyncio.wait_for(handle.stop(), 30)
    assert all(gone(pid) for pid in pids.values()), pids
    assert list_segments(instance) == []


async def test_a_stage_that_never_comes_up_is_named(demo_model_dir) -> None:
    with pytest.raises(StageNotReady, match="(talker|codec)"):
        await launch(load_profile("cpu", ["engine.ready_timeout_s=0.5"]), demo_model_dir)


async def test_request_deadline_fails_the_request_and_frees_it(demo_model_dir) -> None:
    handle = await launch(load_profile("cpu", ["admission.request_timeout_s=1.5"]),
                          demo_model_dir)
    client = handle.client(0)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineFailed, match="deadline"):
            await collect(client, SpeechJob(text="too long", forced_frames=3000))
        assert 1.4 < time.monotonic() - t0 < 5.0
        snap = await settle(client)
        assert snap["running"] == 0 and snap["talker_slots"] == 0 and snap["codec_slots"] == 0
        assert client.healthy()
        chunks = await collect(client, SpeechJob(text="short", forced_frames=2))
        assert chunks[-1].finish_reason == "stop"
    finally:
        await handle.stop()
