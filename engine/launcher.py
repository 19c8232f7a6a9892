"""Launcher: create the channels, spawn the talker and codec workers, run the coordinator.

`await launch(profile, model_dir, clients=N)` returns an `EngineHandle` once every worker has
loaded, warmed up and sent Ready (or raises naming the stage that did not come up, after
cleaning up). With `engine.replicas: R` it starts R talker+codec pairs, replica k on
`engine.devices[k]` (or the derived device, `stages.workers.placement.replica_devices`), its rings named
`r{k}-...` under the instance id; each codec owns one PCM ring per client, so every client reads
one SPSC ring per replica. Every worker inherits the NVLink-multicast-off variables
(`stages.workers.placement.worker_environment`), set in this process's environment before spawning.
The coordinator runs as tasks on the caller's loop, in the caller's process.
`handle.client(i)` is an in-process `EngineClient`; `handle.client_spec(i)` is the picklable spec
a spawned API process passes to `EngineClient.connect`. `await handle.stop()` shuts down (drain or
abort per `engine.shutdown`), joins all workers (SIGKILL after a grace period), closes every
channel and removes this instance's shared-memory segments: no orphan processes, no /dev/shm
leftovers, also after a worker crash. On cuda with `engine.mps`, a private MPS daemon runs for
the workers from launch to stop (`engine.mps`). A replica whose worker dies is restarted in place
(`engine.restarts`); each client slot has a pipe from the handle on which a restarted codec's PCM
ring spec reaches the client (`ClientSpec.rewire`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.client import ClientSpec, EngineClient
from engine.coordinator import Coordinator
from engine.counters import CounterBlock
from engine.mps import MpsDaemon, maybe_start
from engine.replicas import ReplicaChannels, worker_name
from engine.restarts import ReplicaRestarter, RestartPolicy
from engine.worker_procs import (ReplicaWorkers, close_spec, join_or_kill, relay_specs,
                                 replica_channels, spawn_replica)
from ipc.channel import Channel, ChannelSpec
from ipc.messages import ClientInbox, CoordinatorInbox
from ipc.shm import list_segments, new_instance_id, sweep_orphans, unlink_segment
from profiles import Profile
from stages.registry import load_variant
from stages.variant import Variant
from stages.workers.placement import replica_devices, worker_environment

log = logging.getLogger(__name__)


@dataclass
class _Wiring:
    """The coordinator's channel ends and the specs handed to the other processes."""

    replicas: list[ReplicaChannels]
    to_clients: list[Channel]
    from_clients: list[Channel]
    client_pcm: list[list[ChannelSpec]] = field(default_factory=list)  # [replica][client],
    #                                                                   relayed from each codec

    def client_channels(self) -> list[Channel]:
        return [*self.to_clients, *self.from_clients]


def reference_ring_bytes(profile: Profile, variant: Variant) -> int:
    """Capacity of the rings that carry reference waveforms or prompts (client → coordinator →
    codec or talker): the longest accepted reference (`api.max_ref_seconds`, float32 at the
    codec rate) must fit in one record, which is at most half a ring; a prompt of that many bytes
    is far beyond any KV cache. Pages are only touched when used."""
    ref = int(profile.api.max_ref_seconds * variant.sample_rate) * variant.channels * 4
    need = 2 * (ref + 64 * 1024)
    return max(profile.ipc.control_ring_bytes, (need + 63) // 64 * 64)


def _create_wiring(profile: Profile, instance: str, clients: int, ref_bytes: int,
                   replicas: int) -> _Wiring:
    ctl = profile.ipc.control_ring_bytes

    def make(name: str, msg_type: Any, role: str, capacity: int = ctl) -> Channel:
        return Channel.create(name, msg_type=msg_type, capacity=capacity, role=role,
                              instance=instance)

    return _Wiring(
        replicas=[replica_channels(profile, instance, k, ref_bytes) for k in range(replicas)],
        to_clients=[make(f"coord-client{i}", ClientInbox, "writer") for i in range(clients)],
        from_clients=[make(f"client{i}-coord", CoordinatorInbox, "reader", ref_bytes)
                      for i in range(clients)],
    )


@dataclass(frozen=True)
class _SpawnSettings:
    """What starting a replica's workers again needs (`engine.restarts`)."""

    ctx: Any
    devices: list[str]
    env: tuple[tuple[str, str], ...]
    ref_bytes: int


class EngineHandle:
    """A running engine: its workers, coordinator and client endpoints."""

    def __init__(self, profile: Profile, model_dir: Path, variant: Variant, instance: str,
                 wiring: _Wiring, coordinator: Coordinator, counters: CounterBlock,
                 procs: dict[str, Any], spawn: _SpawnSettings, mps: MpsDaemon | None = None) -> None:
        self.mps = mps
        self.profile = profile
        self.model_dir = model_dir
        self.variant = variant
        self.instance = instance
        self.coordinator = coordinator
        self.counters = counters
        self.procs = procs
        self._wiring = wiring
        self._spawn = spawn
        self._clients: dict[int, EngineClient] = {}
        self._rewire = [spawn.ctx.Pipe(duplex=False) for _ in wiring.to_clients]  # (recv, send)
        self._stopped = False
        self.restarter = ReplicaRestarter(self, RestartPolicy.from_profile(profile.engine))
        coordinator.on_replica_failed = self.restarter.schedule

    @property
    def pids(self) -> dict[str, int]:
        return {stage: p.pid for stage, p in self.procs.items()}

    def replica_pids(self, replica: int) -> dict[str, int]:
        """`{"talker": pid, "codec": pid}` of one replica."""
        return {stage: self.procs[worker_name(stage, replica)].pid for stage in ("talker", "codec")}

    @property
    def num_replicas(self) -> int:
        return len(self._wiring.replicas)

    @property
    def num_clients(self) -> int:
        return len(self._wiring.to_clients)

    def client_spec(self, index: int) -> ClientSpec:
        """Picklable spec for the API process that owns client slot `index`."""
        w = self._wiring
        return ClientSpec(index=index, variant=type(self.variant), model_dir=str(self.model_dir),
                          profile=self.profile,
                          to_coord=w.from_clients[index].spec(),
                          from_coord=w.to_clients[index].spec(),
                          from_codecs=tuple(pcm[index] for pcm in w.client_pcm),
                          counters_name=self.counters.name,
                          counters_hist=self.counters.hist_size,
                          counters_replicas=self.counters.replicas,
                          watch_pids=(os.getpid(),),  # workers: the coordinator reports them
                          rewire=self._rewire[index][0])

    def client(self, index: int = 0) -> EngineClient:
        """The in-process client for slot `index` (opened once, closed by `stop`)."""
        if index not in self._clients:
            self._clients[index] = EngineClient.connect(self.client_spec(index))
        return self._clients[index]

    # ---- for engine.restarts ------------------------------------------------------------------

    def worker_names(self, replica: int) -> list[str]:
        return [worker_name(stage, replica) for stage in ("talker", "codec")]

    def spawn_replica(self, replica: int, channels: ReplicaChannels, workers: ReplicaWorkers) -> None:
        """Start replica `replica`'s workers on `channels` (into `workers` and `procs`)."""
        try:
            spawn_replica(self._spawn.ctx, self.profile, type(self.variant), str(self.model_dir),
                          self.instance, replica, self._spawn.devices[replica], channels,
                          self.num_clients, self._spawn.env, workers)
        finally:
            self.procs.update(workers.procs)

    def new_replica_channels(self, replica: int, generation: int) -> ReplicaChannels:
        return replica_channels(self.profile, self.instance, replica, self._spawn.ref_bytes,
                                generation)

    def take_client_pcm(self, replica: int) -> list[ChannelSpec]:
        """Forget the PCM ring specs of `replica`'s old codec (returned)."""
        specs, self._wiring.client_pcm[replica] = self._wiring.client_pcm[replica], []
        return specs

    def give_client_pcm(self, replica: int, specs: list[ChannelSpec]) -> None:
        """A restarted codec's PCM rings, one per client: each client slot gets its own."""
        self._wiring.client_pcm[replica] = list(specs)
        for (_, sender), spec in zip(self._rewire, specs):
            try:
                sender.send((replica, spec))
            except OSError as exc:  # that API process has gone: the supervisor handles it
                log.warning("replica %d: cannot hand a client its new PCM ring: %s", replica, exc)

    # ---- stopping -----------------------------------------------------------------------------

    async def stop(self, timeout_s: float | None = None) -> None:
        """Shut down; idempotent. Leaves no processes and no shared-memory segments."""
        if self._stopped:
            return
        self._stopped = True
        try:
            await self.restarter.close()
            await self.coordinator.shutdown(timeout_s)
        finally:
            for client in self._clients.values():
                await client.close()
            await join_or_kill(self.procs)
            if self.mps is not None:
                await asyncio.to_thread(self.mps.stop)
            await self.coordinator.close()
            for replica in self.coordinator.replicas:
                for ch in replica.channels.all():
                    ch.close()
            for ch in self._wiring.client_channels():
                ch.close()
            for spec in (s for pcm in self._wiring.client_pcm for s in pcm):
                close_spec(spec)
            for receiver, sender in self._rewire:
                receiver.close()
                sender.close()
            self.counters.close()
            _remove_segments(self.instance)

    async def __aenter__(self) -> EngineHandle:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()


async def launch(profile: Profile, model_dir: str | Path, *, clients: int = 1) -> EngineHandle:
    """Spawn every replica's workers and start the coordinator; returns when all are Ready."""
    model_dir = Path(model_dir)
    variant = load_variant(model_dir, profile)  # fails fast on an unknown model
    devices = replica_devices(profile)  # fails fast when the replicas do not fit the GPUs
    instance = new_instance_id()
    ref_bytes = reference_ring_bytes(profile, variant)
    wiring = _create_wiring(profile, instance, clients, ref_bytes, len(devices))
    counters = CounterBlock.create(instance, max(profile.coalescing.max_batch,
                                                 profile.talker.max_running), len(devices))
    mps = await asyncio.to_thread(maybe_start, profile.engine.mps, devices[0])
    env = tuple(mps.env.items()) if mps is not None else ()
    if mps is None and any(getattr(profile, stage).sm_percent or getattr(profile, stage).mps_priority != "normal"
                           for stage in ("talker", "codec")):
        log.warning("talker/codec sm_percent and mps_priority need MPS (engine.mps on cuda): ignored")
    os.environ.update(worker_environment())  # inherited by every worker spawned below
    ctx = mp.get_context("spawn")
    workers = [ReplicaWorkers() for _ in devices]
    coordinator = Coordinator(profile, replicas=wiring.replicas, to_clients=wiring.to_clients,
                              from_clients=wiring.from_clients, counters=counters,
                              sample_rate=variant.sample_rate)
    try:
        for k, (device, ch) in enumerate(zip(devices, wiring.replicas)):
            spawn_replica(ctx, profile, type(variant), str(model_dir), instance, k, device, ch,
                          clients, env, workers[k])
        counters["healthy"] = 1
        coordinator.start()
        timeout = profile.engine.ready_timeout_s
        for k in range(len(devices)):
            wiring.client_pcm.append(await relay_specs(workers[k], k, timeout))
        await coordinator.wait_ready(timeout)
    except BaseException:
        await coordinator.close()
        await join_or_kill({n: p for w in workers for n, p in w.procs.items()}, grace_s=0.0)
        for ch in [*(c for r in wiring.replicas for c in r.all()), *wiring.client_channels()]:
            ch.close()
        counters.close()
        _remove_segments(instance)
        if mps is not None:
            await asyncio.to_thread(mps.stop)
        raise
    finally:
        for w in workers:
            w.close_pipes()
    procs = {n: p for w in workers for n, p in w.procs.items()}
    for k, device in enumerate(devices):
        log.info("engine %s replica %d ready: talker pid %d, codec pid %d, %d client slot(s), "
                 "device %s", instance, k, procs[worker_name("talker", k)].pid,
                 procs[worker_name("codec", k)].pid, clients, device)
    return EngineHandle(profile, model_dir, variant, instance, wiring, coordinator, counters,
                        procs, _SpawnSettings(ctx, devices, env, ref_bytes), mps)


def _remove_segments(instance: str) -> None:
    """Unlink what is left of this instance in /dev/shm (owners died before closing)."""
    sweep_orphans(instance)
    for name in list_segments(instance):
        unlink_segment(name)
