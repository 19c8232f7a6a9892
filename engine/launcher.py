"""Launcher: create the channels, spawn the talker and codec workers, run the coordinator.

`await launch(profile, model_dir, clients=N)` returns an `EngineHandle` once every worker has
loaded, warmed up and sent Ready (or raises naming the stage that did not come up, after
cleaning up). With `engine.replicas: R` it starts R talker+codec pairs, replica k on
`engine.devices[k]` (or the derived device, `stages.workers.placement.replica_devices`), its rings named
`r{k}-...` under the instance id; each codec owns one PCM ring per client, so every client reads
one SPSC ring per replica. Every worker inherits the NVLink-multicast-off variables
(`stages.workers.placement.worker_environment`), set in this process's environment before spawning,
and runs with its compile caches in `engine.compile_cache_dir` (`compile_cache_environment`: in its
spec, set before it imports a model), which the launch logs.
The coordinator runs as tasks on the caller's loop, in the caller's process.
`handle.client(i)` is an in-process `EngineClient`; `handle.client_spec(i)` is the picklable spec
a spawned API process passes to `EngineClient.connect`. `await handle.stop()` shuts down (drain or
abort per `engine.shutdown`), joins all workers (SIGKILL after a grace period), closes every
channel and removes this instance's shared-memory segments: no orphan processes, no /dev/shm
leftovers, also after a worker crash. On cuda with `engine.mps`, a private MPS daemon runs for
the workers from launch to stop (`engine.mps`). A worker that dies or hangs is replaced in place,
its peer serving on (`engine.restarts`); each client slot has a pipe from the handle on which a
restarted codec's PCM ring spec reaches the client (`ClientSpec.rewire`). An API process that
dies is replaced in its slot: `await handle.replace_client(i)` gives the new process's spec (new
coordinator channels, a new PCM ring from every codec, request ids of a new generation).
At launch, shared-memory segments whose owner process is gone (a server killed before it could
clean up) are swept, whatever their instance.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.client import ClientSpec, EngineClient
from engine.coordinator import Coordinator
from engine.counters import CounterBlock
from engine.mps import MpsDaemon, maybe_start
from engine.replicas import ReplicaChannels, worker_name
from engine.restarts import ReplicaRestarter, RestartPolicy
from engine.worker_procs import (ReplicaWorkers, close_spec, join_or_kill, receive_spec,
                                 relay_specs, replica_channels, spawn_replica, spawn_worker,
                                 worker_channels)
from ipc.channel import Channel, ChannelSpec
from ipc.messages import ClientInbox, CoordinatorInbox, Ready, Rewire
from ipc.shm import list_segments, new_instance_id, sweep_orphans, unlink_segment
from profiles import Profile
from stages.registry import load_variant
from stages.variant import Variant
from stages.workers.placement import (INDUCTOR_CACHE_VAR, TRITON_CACHE_VAR, compile_cache_environment,
                                      replica_devices, worker_environment)

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
    pairs = [client_channels(profile, instance, i, ref_bytes) for i in range(clients)]
    return _Wiring(
        replicas=[replica_channels(profile, instance, k, ref_bytes) for k in range(replicas)],
        to_clients=[to for to, _ in pairs],
        from_clients=[frm for _, frm in pairs],
    )


def client_channels(profile: Profile, instance: str, index: int, ref_bytes: int,
                    generation: int = 0) -> tuple[Channel, Channel]:
    """The coordinator's (to, from) channels to API process slot `index` (its `generation`-th
    process)."""
    tag = "" if generation == 0 else f"g{generation}"
    return (Channel.create(f"coord-client{index}{tag}", msg_type=ClientInbox,
                           capacity=profile.ipc.control_ring_bytes, role="writer", instance=instance),
            Channel.create(f"client{index}{tag}-coord", msg_type=CoordinatorInbox, capacity=ref_bytes,
                           role="reader", instance=instance))


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
                 procs: dict[str, Any], spawn: _SpawnSettings, mps: MpsDaemon | None = None,
                 pipes: dict[str, Any] | None = None) -> None:
        self.mps = mps
        self.profile = profile
        self.model_dir = model_dir
        self.variant = variant
        self.instance = instance
        self.coordinator = coordinator
        self.counters = counters
        self.procs = procs
        self.pipes: dict[str, Any] = dict(pipes or {})  # each worker's set-up pipe, for its life
        self._relay_locks: dict[int, asyncio.Lock] = {}
        self._client_generations = [0] * len(wiring.to_clients)
        self._wiring = wiring
        self._spawn = spawn
        self._clients: dict[int, EngineClient] = {}
        self._rewire = [spawn.ctx.Pipe(duplex=False) for _ in wiring.to_clients]  # (recv, send)
        self._stopped = False
        self.restarter = ReplicaRestarter(self, RestartPolicy.from_profile(profile.engine))
        coordinator.on_worker_failed = self.restarter.schedule

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
                          from_codecs=tuple(pcm[index] if index < len(pcm) else None
                                            for pcm in w.client_pcm),  # None: being restarted
                          counters_name=self.counters.name,
                          counters_hist=self.counters.hist_size,
                          counters_replicas=self.counters.replicas,
                          watch_pids=(os.getpid(),),  # workers: the coordinator reports them
                          rewire=self._rewire[index][0],
                          generation=self._client_generations[index])

    def client(self, index: int = 0) -> EngineClient:
        """The in-process client for slot `index` (opened once, closed by `stop`)."""
        if index not in self._clients:
            self._clients[index] = EngineClient.connect(self.client_spec(index))
        return self._clients[index]

    # ---- for engine.restarts ------------------------------------------------------------------

    def worker_names(self, replica: int) -> list[str]:
        return [worker_name(stage, replica) for stage in ("talker", "codec")]

    def spawn_replica(self, replica: int, channels: ReplicaChannels, workers: ReplicaWorkers) -> None:
        """Start replica `replica`'s workers on `channels` (into `workers`, `procs`, `pipes`)."""
        try:
            spawn_replica(self._spawn.ctx, self.profile, type(self.variant), str(self.model_dir),
                          self.instance, replica, self._spawn.devices[replica], channels,
                          self.num_clients, self._spawn.env, workers)
        finally:
            self.procs.update(workers.procs)
            self.pipes.update(workers.pipes)

    def spawn_worker(self, replica: int, stage: str, to_worker: Channel, from_worker: Channel,
                     workers: ReplicaWorkers) -> None:
        """Start worker `stage` of `replica` again, with the spec of its first start but for the
        channels (into `workers`, `procs`, `pipes`)."""
        try:
            spawn_worker(self._spawn.ctx, self.profile, type(self.variant), str(self.model_dir),
                         self.instance, replica, self._spawn.devices[replica], stage, to_worker,
                         from_worker, self.num_clients, self._spawn.env, workers)
        finally:
            self.procs.update(workers.procs)
            self.pipes.update(workers.pipes)

    def forget_workers(self, workers: ReplicaWorkers) -> None:
        """Workers of a failed restart (reaped by the caller): out of `procs`, pipes closed."""
        for name in workers.procs:
            self.procs.pop(name, None)
            self.close_pipe(name)

    def close_pipe(self, name: str) -> None:
        pipe = self.pipes.pop(name, None)
        if pipe is not None:
            pipe.close()

    def relay_lock(self, replica: int) -> asyncio.Lock:
        """Held while anything talks to replica `replica`'s workers over their set-up pipes (a
        restart's relay, a new API process's PCM ring): one conversation at a time."""
        return self._relay_locks.setdefault(replica, asyncio.Lock())

    def new_replica_channels(self, replica: int, generation: int) -> ReplicaChannels:
        return replica_channels(self.profile, self.instance, replica, self._spawn.ref_bytes,
                                generation)

    def new_worker_channels(self, replica: int, stage: str, generation: int) -> tuple[Channel, Channel]:
        return worker_channels(self.profile, self.instance, replica, self._spawn.ref_bytes, stage,
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

    async def replace_client(self, index: int) -> ClientSpec:
        """API process slot `index` lost its process: new coordinator channels (its old requests
        are aborted), a new PCM ring from every live codec, a new rewire pipe and request ids of
        a new generation. Returns the spec to spawn the new process with; the other API
        processes notice nothing."""
        t0 = time.monotonic()
        generation = self._client_generations[index] + 1
        to_client, from_client = client_channels(self.profile, self.instance, index,
                                                 self._spawn.ref_bytes, generation)
        for channel in self.coordinator.swap_client(index, to_client, from_client):
            channel.close()
        self._wiring.to_clients[index], self._wiring.from_clients[index] = to_client, from_client
        receiver, sender = self._rewire[index]
        receiver.close()
        sender.close()
        self._rewire[index] = self._spawn.ctx.Pipe(duplex=False)
        self._client_generations[index] = generation
        timeout = self.profile.engine.ready_timeout_s
        for replica in range(self.num_replicas):
            async with self.relay_lock(replica):
                codec = self.pipes.get(worker_name("codec", replica))
                if codec is None or "codec" in self.coordinator.replicas[replica].down:
                    continue  # being restarted: its new rings reach the client by the rewire pipe
                self.coordinator.rewire_survivor(replica, Rewire(stage="client", client=index,
                                                                 generation=generation))
                spec = await receive_spec(codec, timeout, f"codec {replica}'s new PCM ring")
                pcm = self._wiring.client_pcm[replica]
                if index < len(pcm):
                    close_spec(pcm[index])
                    pcm[index] = spec
                else:  # its codec was replaced meanwhile; the rewire pipe brings the new ring
                    close_spec(spec)
        self.counters.add("api_restarts")
        log.info("API process slot %d rewired in %.2f s", index, time.monotonic() - t0)
        return self.client_spec(index)

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
            for name in list(self.pipes):
                self.close_pipe(name)
            self.counters.close()
            _remove_segments(self.instance)

    async def __aenter__(self) -> EngineHandle:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()


async def launch(profile: Profile, model_dir: str | Path, *, clients: int = 1) -> EngineHandle:
    """Spawn every replica's workers and start the coordinator; returns when all are Ready (and
    has logged where each worker's start-up time went, `log_startup`)."""
    t0 = time.monotonic()
    model_dir = Path(model_dir)
    variant = load_variant(model_dir, profile)  # fails fast on an unknown model
    devices = replica_devices(profile)  # fails fast when the replicas do not fit the GPUs
    swept = sweep_orphans()  # every instance's: segments of servers killed before their clean-up
    if swept:
        log.info("removed %d shared-memory segment(s) left by processes that are gone", len(swept))
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
    log_compile_caches(profile)
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
        readies = await coordinator.wait_ready(timeout)
    except BaseException:
        await coordinator.close()
        await join_or_kill({n: p for w in workers for n, p in w.procs.items()}, grace_s=0.0)
        for w in workers:
            w.close_pipes()
        for ch in [*(c for r in wiring.replicas for c in r.all()), *wiring.client_channels()]:
            ch.close()
        counters.close()
        _remove_segments(instance)
        if mps is not None:
            await asyncio.to_thread(mps.stop)
        raise
    procs = {n: p for w in workers for n, p in w.procs.items()}
    for k, device in enumerate(devices):
        log.info("engine %s replica %d ready: talker pid %d, codec pid %d, %d client slot(s), "
                 "device %s", instance, k, procs[worker_name("talker", k)].pid,
                 procs[worker_name("codec", k)].pid, clients, device)
    log_startup(time.monotonic() - t0, readies)
    return EngineHandle(profile, model_dir, variant, instance, wiring, coordinator, counters,
                        procs, _SpawnSettings(ctx, devices, env, ref_bytes), mps,
                        pipes={n: c for w in workers for n, c in w.pipes.items()})


def log_startup(seconds: float, readies: dict[str, Ready]) -> None:
    """The start-up's last line: seconds from `launch` to every worker's Ready, and each worker's
    phases from its spawn (`Ready.startup`), which add up to its own total."""
    parts = []
    for name, ready in readies.items():  # keys `talker`, `codec`, `talker.1`, ...: named as the workers log
        stage, _, replica = name.partition(".")
        t = ready.startup
        if t is not None:
            parts.append(f"{stage}{replica or 0} {t.total:.1f} s (start {t.start:.1f}, load {t.load:.1f}, "
                         f"compile {t.compile:.1f}, capture {t.capture:.1f}, warm-up {t.warm_up:.1f})")
    log.info("engine ready in %.1f s after launch; %s", seconds, "; ".join(parts) or "no worker timed its start-up")


def log_compile_caches(profile: Profile) -> None:
    """Say where the workers' compile caches are (`engine.compile_cache_dir`, or the server's
    environment), or why torch's own places are used."""
    env = {**os.environ, **compile_cache_environment(profile)}
    inductor, triton = env.get(INDUCTOR_CACHE_VAR), env.get(TRITON_CACHE_VAR)
    if profile.engine.compile_cache_dir is not None and inductor is None:
        log.warning("engine.compile_cache_dir %s cannot be made: the workers compile into torch's own "
                    "places, and a new machine compiles everything again", profile.engine.compile_cache_dir)
        return
    log.info("compile caches: inductor %s, triton %s", inductor or "torch's own place",
             triton or "Triton's own place")


def _remove_segments(instance: str) -> None:
    """Unlink what is left of this instance in /dev/shm (owners died before closing)."""
    sweep_orphans(instance)
    for name in list_segments(instance):
        unlink_segment(name)
