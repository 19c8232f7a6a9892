"""A SIGKILLed worker: every in-flight request fails within 2 s; the dead worker alone is replaced
(its peer keeps its process and state) and the replica serves again (or, with restarts off, the
engine says it is unhealthy); a stopped worker is noticed by its beat and replaced the same way;
stopping the engine afterwards leaves no process and no shared-memory segment behind. Records too
large for a ring."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time

import numpy as np
import psutil
import pytest

from engine.client import EngineFailed
from engine.coordinator import StageNotReady
from engine.launcher import launch
from engine.restarts import MAX_BACKOFF_S, RestartPolicy
from ipc.channel import max_payload_bytes
from ipc.shm import list_segments
from profiles import load_profile
from speech.job import SpeechJob
from tests.engine.conftest import collect, joined, settle


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
    """Without restarts (engine.restart_limit 0) the engine of one replica fails for good."""
    handle = await launch(load_profile("cpu", ["engine.restart_limit=0"]), demo_model_dir)
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


async def test_a_stage_that_fails_at_start_says_why_at_once(demo_model_dir, tmp_path) -> None:
    """A worker whose start-up raises (here: a talker whose weights are not a safetensors file; on
    a GPU, a memory plan the card cannot hold) fails the launch with its own message as soon as it
    reports, not after the ready timeout."""
    broken = tmp_path / "model"
    shutil.copytree(demo_model_dir, broken)
    for weights in broken.glob("*.safetensors"):  # the talker's own, not audio_tokenizer/'s
        weights.write_bytes(b"not a safetensors file")
    t0 = time.monotonic()
    with pytest.raises(StageNotReady, match="the talker worker failed before Ready: "):
        await launch(load_profile("cpu", ["engine.ready_timeout_s=120"]), broken)
    assert time.monotonic() - t0 < 60


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


async def test_a_chunk_too_large_for_one_record_travels_in_several(demo_model_dir) -> None:
    """A first chunk of 60 frames is 1.8 MB of 48 kHz stereo PCM and 5.8 kB of codes: with rings
    whose records hold 17 frames of PCM and 20 of codes, both workers split it into records that
    fit. The audio matches that of the same request cut the usual way, and the engine lives on."""
    profile = load_profile("cpu", ["ipc.pcm_ring_bytes=1048576", "ipc.codes_ring_bytes=4096"])
    handle = await launch(profile, demo_model_dir)
    client = handle.client(0)
    try:
        job = dict(text="split", forced_frames=60, sampling={"seed": 7})
        whole = await collect(client, SpeechJob(**job, initial_chunk_frames=60))
        usual = await collect(client, SpeechJob(**job))
        assert max(c.pcm.shape[0] for c in whole) <= max_payload_bytes(1048576) // 8 and len(whole) >= 4
        assert joined(whole).shape == joined(usual).shape == (60 * 3840, 2)
        np.testing.assert_allclose(joined(whole), joined(usual), atol=1e-4)  # chunking: float order
        assert client.healthy() and client.ready()
        snap = await settle(client)
        assert snap["failed"] == 0 and snap["codec_slots"] == 0
    finally:
        await handle.stop()


@pytest.mark.parametrize("stage", ["codec", "talker"])
async def test_a_killed_worker_is_replaced_alone_and_the_engine_serves_again(demo_model_dir, stage) -> None:
    """The only replica's worker is SIGKILLed mid-stream: its requests fail at once (as the
    engine could not serve them: reason "worker_lost"), the engine is not ready while that worker
    is replaced (a new process, new rings, for a codec the client's new PCM ring), its peer keeps
    running in the same process, then the engine is ready again by itself, serving requests and
    reference encodes, with the restart counted for that stage."""
    profile = load_profile("cpu", ["engine.restart_backoff_s=0.2"])
    handle = await launch(profile, demo_model_dir)
    instance, old = handle.instance, dict(handle.pids)
    client = handle.client(0)
    try:
        tasks = [asyncio.create_task(collect(client, SpeechJob(text="long", forced_frames=3000,
                                                               sampling={"seed": i})))
                 for i in range(2)]
        await wait_for(lambda: client.counters()["chunks"] >= 2, 20)
        os.kill(old[stage], signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert all(isinstance(r, EngineFailed) and r.unavailable for r in results), results
        await wait_for(lambda: not client.ready(), 5)
        assert client.healthy()  # restarting, not failed
        await wait_for(client.ready, 90)
        new = dict(handle.pids)
        peer = "talker" if stage == "codec" else "codec"
        assert set(new) == set(old) and new[stage] != old[stage] and new[peer] == old[peer]
        assert gone(old[stage]) and not gone(old[peer])
        chunks = await collect(client, SpeechJob(text="after the restart", forced_frames=3))
        assert chunks[-1].finish_reason == "stop" and sum(len(c.pcm) for c in chunks) == 3 * 3840
        snap = await settle(client)
        assert snap["restarts"] == 1 and snap["replica0_restarts"] == 1 and snap["replicas_up"] == 1
        assert snap[f"{stage}_restarts"] == 1 and snap[f"{peer}_restarts"] == 0
        assert snap["running"] == 0 and snap["codec_slots"] == 0 and snap["talker_slots"] == 0
        codes = await client.encode_reference(np.zeros((client.channels, 48000), np.float32))
        assert codes.shape[1] == client.n_vq
    finally:
        await asyncio.wait_for(handle.stop(), 30)
    assert all(gone(pid) for pid in new.values())
    assert list_segments(instance) == []


def test_restart_policy_backs_off_and_stops_at_its_limit() -> None:
    now = [0.0]
    policy = RestartPolicy(limit=3, window_s=100.0, backoff_s=1.0, clock=lambda: now[0])
    assert [policy.next_delay(0) for _ in range(3)] == [1.0, 2.0, 4.0]
    assert policy.next_delay(0) is None  # three within the window: replica 0 stays down
    assert policy.next_delay(1) == 1.0  # counted per replica
    now[0] = 150.0  # the first restarts have left the window
    assert policy.next_delay(0) == 1.0
    assert RestartPolicy(limit=0, window_s=1.0, backoff_s=1.0).next_delay(0) is None
    slow = RestartPolicy(limit=20, window_s=1e9, backoff_s=1.0, clock=lambda: 0.0)
    assert max(slow.next_delay(0) for _ in range(20)) == MAX_BACKOFF_S


@pytest.mark.parametrize("stage", ["codec", "talker"])
async def test_a_stopped_worker_is_noticed_by_its_beat_and_replaced(demo_model_dir, stage) -> None:
    """SIGSTOP leaves the process alive (no pidfd wakes anyone): its beat stands still, so after
    `engine.liveness_timeout_s` it is killed and replaced like a dead one; its requests fail as
    "worker_lost" instead of waiting for their deadline, and the engine serves again. The
    engine stops saying ready the moment it kills the worker, not once the death is reported."""
    profile = load_profile("cpu", ["engine.restart_backoff_s=0.1", "engine.liveness_timeout_s=1.5",
                                   "admission.request_timeout_s=120"])
    handle = await launch(profile, demo_model_dir)
    old = dict(handle.pids)
    client = handle.client(0)
    coordinator = handle.coordinator
    kill_hung, ready_after_kill = coordinator._kill_hung, []

    def watched_kill_hung(*args) -> None:  # the handlers never await: nothing runs in between
        kill_hung(*args)
        ready_after_kill.append(coordinator.counters["ready"])

    coordinator._kill_hung = watched_kill_hung
    try:
        idle_beats = handle.coordinator.replicas[0].channels.of(stage)[1].beats
        await asyncio.sleep(1.0)  # an idle worker beats too: liveness is not mistaken for work
        assert handle.coordinator.replicas[0].channels.of(stage)[1].beats > idle_beats
        task = asyncio.create_task(collect(client, SpeechJob(text="long", forced_frames=3000)))
        await wait_for(lambda: client.counters()["chunks"] >= 1, 20)
        os.kill(old[stage], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineFailed) as failed:
            await asyncio.wait_for(task, 15)
        assert failed.value.reason == "worker_lost"
        assert time.monotonic() - t0 < 10, "the hung worker was not noticed in time"
        await wait_for(lambda: gone(old[stage]), 10)
        await wait_for(client.ready, 90)
        assert handle.pids[stage] != old[stage]
        chunks = await collect(client, SpeechJob(text="after", forced_frames=2))
        assert chunks[-1].finish_reason == "stop"
        snap = await settle(client)
        assert snap["hung_workers"] == 1 and snap[f"{stage}_restarts"] == 1
        assert ready_after_kill == [0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old[stage], signal.SIGCONT)
        await asyncio.wait_for(handle.stop(), 30)
