"""Replicas (`engine.replicas: 2`) on CPU: two talker+codec pairs behind one coordinator.

Real processes and rings with the tiny demo model: requests land on both replicas (per-replica
counters) and each one's audio equals a one-replica engine's for the same seed; a SIGKILLed
talker or codec of one replica fails only that replica's requests, fast, while the engine stays
healthy and ready with one replica up and serves new requests on it; stopping leaves nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from engine.client import EngineFailed
from engine.launcher import launch
from engine.replicas import Replica, ReplicaSet
from ipc.shm import list_segments
from profiles import ProfileError, load_profile
from speech.job import SpeechJob
from stages.workers.placement import PlacementError, replica_devices, worker_environment
from tests.engine.conftest import collect, joined, settle
from tests.engine.test_engine_faults import gone, wait_for

TWO = ["engine.replicas=2"]
NO_RESTART = ["engine.restart_limit=0"]  # the failed replica stays down (restarts: test_engine_faults)


def environment(pid: int) -> dict[str, str]:
    raw = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def jobs(n: int, frames: int) -> list[SpeechJob]:
    return [SpeechJob(text=f"replica request {i}", forced_frames=frames + 3 * i,
                      sampling={"seed": 100 + i}) for i in range(n)]


async def run_all(client, batch: list[SpeechJob]) -> list[np.ndarray]:
    results = await asyncio.gather(*(collect(client, job) for job in batch))
    return [joined(chunks) for chunks in results]


async def test_two_replicas_serve_concurrently_and_sound_like_one(demo_model_dir) -> None:
    batch = jobs(4, 20)
    one = await launch(load_profile("cpu"), demo_model_dir)
    try:
        expected = await run_all(one.client(0), batch)
    finally:
        await one.stop()
    two = await launch(load_profile("cpu", TWO), demo_model_dir)
    instance, pids = two.instance, dict(two.pids)
    try:
        assert sorted(pids) == ["codec", "codec.1", "talker", "talker.1"]
        assert len(set(pids.values())) == 4
        for pid in pids.values():  # NVLink multicast off in every worker's environment
            env = environment(pid)
            assert all(env.get(k) == v for k, v in worker_environment().items()), pid
        client = two.client(0)
        got = await run_all(client, batch)
        snap = await settle(client)
        assert snap["replica0_dispatched"] == 2 and snap["replica1_dispatched"] == 2, snap
        assert snap["replicas"] == 2 and snap["replicas_up"] == 2
        assert snap["talker_capacity"] == 2 * 16 and snap["codec_capacity"] == 2 * 16
        assert snap["finished_stop"] == 4 and snap["failed"] == 0
        assert snap["running"] == 0 and snap["replica0_running"] == snap["replica1_running"] == 0
        for audio, reference in zip(got, expected):
            assert audio.shape == reference.shape and np.abs(audio).max() > 0
            np.testing.assert_allclose(audio, reference, atol=1e-4, rtol=0)
        codes = await client.encode_reference(np.zeros((client.channels, 48000), np.float32))
        assert codes.shape[1] == client.n_vq
    finally:
        await two.stop()
    assert all(gone(pid) for pid in pids.values()), pids
    assert list_segments(instance) == []


@pytest.mark.parametrize("stage", ["talker", "codec"])
async def test_a_killed_replica_fails_only_its_requests(demo_model_dir, stage) -> None:
    handle = await launch(load_profile("cpu", [*TWO, *NO_RESTART]), demo_model_dir)
    instance, pids = handle.instance, dict(handle.pids)
    victim = handle.replica_pids(1)
    client = handle.client(0)
    try:
        tasks = [asyncio.create_task(collect(client, SpeechJob(text="long", forced_frames=3000,
                                                               sampling={"seed": i})))
                 for i in range(4)]  # routed 0, 1, 0, 1 (most headroom, lowest index on ties)
        await wait_for(lambda: client.counters()["chunks"] >= 4, 20)
        assert client.counters()["replica1_running"] == 2
        os.kill(victim[stage], signal.SIGKILL)
        t0 = time.monotonic()
        await wait_for(lambda: sum(t.done() for t in tasks) >= 2, 10)
        elapsed = time.monotonic() - t0
        assert elapsed < 2.0, f"replica 1's requests took {elapsed:.2f} s to fail"
        await asyncio.sleep(0.5)  # nothing else fails
        failed = [i for i, t in enumerate(tasks) if t.done()]
        assert failed == [1, 3], failed
        assert all(isinstance(tasks[i].exception(), EngineFailed) for i in failed)
        assert not tasks[0].done() and not tasks[2].done()  # replica 0 keeps streaming
        snap = client.counters()
        assert snap["replicas_up"] == 1 and snap["replica1_up"] == 0 and snap["replica0_up"] == 1
        assert client.healthy() and client.ready()
        await wait_for(lambda: gone(victim["talker"]) and gone(victim["codec"]), 10)
        for i in (0, 2):
            tasks[i].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        before = client.counters()["replica0_dispatched"]
        after = await run_all(client, jobs(3, 4))
        assert all(len(a) > 0 for a in after)
        snap = await settle(client)
        assert snap["replica0_dispatched"] == before + 3 and snap["replica1_dispatched"] == 2
        assert snap["talker_capacity"] == 16 and snap["running"] == 0 and snap["failed"] == 2
        assert snap["ring_bytes"] == 0  # the dead replica's unread rings are no backlog
        assert client.healthy() and client.ready()
    finally:
        await asyncio.wait_for(handle.stop(), 30)
    assert all(gone(pid) for pid in pids.values()), pids
    assert list_segments(instance) == []


async def test_queued_requests_survive_a_replica_failure(demo_model_dir) -> None:
    """One slot per replica: two long requests run (one each), two wait in the shared queue; the
    kill fails only replica 1's request, and the queued ones then run on replica 0."""
    handle = await launch(load_profile("cpu", [*TWO, *NO_RESTART, "admission.max_running=1"]),
                          demo_model_dir)
    client = handle.client(0)
    try:
        long = [asyncio.create_task(collect(client, SpeechJob(text="long", forced_frames=3000,
                                                              sampling={"seed": i})))
                for i in range(2)]
        await wait_for(lambda: client.counters()["chunks"] >= 2, 20)
        queued = [asyncio.create_task(run_all(client, [job])) for job in jobs(2, 4)]
        await wait_for(lambda: client.counters()["queued"] == 2, 5)
        os.kill(handle.replica_pids(1)["talker"], signal.SIGKILL)
        with pytest.raises(EngineFailed):
            await asyncio.wait_for(long[1], 2)
        assert not long[0].done() and not any(t.done() for t in queued)
        assert client.counters()["queued"] == 2  # nothing was lost: they wait for replica 0
        long[0].cancel()
        done = await asyncio.wait_for(asyncio.gather(*queued), 30)
        assert all(len(audio[0]) > 0 for audio in done)
        snap = await settle(client)
        assert snap["replica0_dispatched"] == 3 and snap["replica1_dispatched"] == 1
        assert snap["replicas_up"] == 1 and client.ready()
    finally:
        await asyncio.wait_for(handle.stop(), 30)


# ---- routing and placement without processes -------------------------------------------------


def _replica(index: int, capacity: int, running: int, up: bool = True) -> Replica:
    r = Replica.__new__(Replica)  # no channels: the routing rule only reads the state
    r.index, r.capacity, r.up, r.running, r.jobs = index, capacity, up, set(range(running)), set()
    return r


def test_routing_picks_the_live_replica_with_most_headroom() -> None:
    assert ReplicaSet([_replica(0, 4, 3), _replica(1, 4, 1), _replica(2, 4, 2)]).pick().index == 1
    assert ReplicaSet([_replica(0, 4, 1), _replica(1, 4, 1)]).pick().index == 0  # tie: lowest
    assert ReplicaSet([_replica(0, 4, 3), _replica(1, 4, 0, up=False)]).pick().index == 0
    assert ReplicaSet([_replica(0, 2, 2), _replica(1, 2, 2)]).pick() is None  # all full
    assert ReplicaSet([_replica(0, 2, 0, up=False)]).pick() is None
    assert ReplicaSet([_replica(0, 4, 3), _replica(1, 8, 4)]).live_capacity == 12


def test_profile_devices_and_placement() -> None:
    assert replica_devices(load_profile("cpu", TWO)) == ["cpu", "cpu"]
    assert replica_devices(load_profile("cpu", [*TWO, "engine.devices=[cpu, cpu]"])) == ["cpu"] * 2
    with pytest.raises(ProfileError, match="one device per replica"):
        load_profile("cpu", [*TWO, "engine.devices=[cpu]"])
    with pytest.raises(ProfileError, match="overlap"):
        load_profile("default", [*TWO, "engine.devices=[cuda:0, cuda:1]",
                                 "talker.tensor_parallel=2"])
    gpus = load_profile("default", [*TWO, "model.device=cuda", "engine.devices=[cuda:0, cuda:2]",
                                    "talker.tensor_parallel=2"])
    import torch

    if torch.cuda.device_count() < 4:
        with pytest.raises(PlacementError, match="need 4 GPUs"):
            replica_devices(gpus)
    else:
        assert replica_devices(gpus) == ["cuda:0", "cuda:2"]
