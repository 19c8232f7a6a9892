"""One replica's worker processes: its coordinator channels, spawning its talker and codec, the
spec relay, and reaping them.

The launcher starts every replica with these at launch; `engine.restarts` starts a failed worker
(or a whole replica) again with them, with the same spec but for its channels. A ring is opened
once, by one peer, so every start gets new channels (ring names carry the start's generation:
`r{k}-...` first, `r{k}g{n}-...` for the n-th restart) and a new codec creates new PCM rings for
the clients, which the caller hands on to them. Each worker's set-up pipe stays open for its
life: replaced peers' ring specs travel on it (`receive_spec`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from engine.mps import client_env
from engine.replicas import ReplicaChannels, worker_name
from ipc.channel import Channel, ChannelSpec
from ipc.messages import CodecInbox, CoordinatorInbox, TalkerInbox
from profiles import Profile
from stages.variant import Variant
from stages.workers import codec, talker
from stages.workers.common import WorkerSpec
from stages.workers.placement import compile_cache_environment

log = logging.getLogger(__name__)

JOIN_GRACE_S = 5.0


def replica_channels(profile: Profile, instance: str, replica: int, ref_bytes: int,
                     generation: int = 0) -> ReplicaChannels:
    """The coordinator's four channels to replica `replica` (the rings that carry prompts and
    reference waveforms hold `ref_bytes`)."""
    to_talker, from_talker = worker_channels(profile, instance, replica, ref_bytes, "talker", generation)
    to_codec, from_codec = worker_channels(profile, instance, replica, ref_bytes, "codec", generation)
    return ReplicaChannels(to_talker=to_talker, from_talker=from_talker, to_codec=to_codec,
                           from_codec=from_codec)


def worker_channels(profile: Profile, instance: str, replica: int, ref_bytes: int, stage: str,
                    generation: int = 0) -> tuple[Channel, Channel]:
    """The coordinator's (to, from) channels to one worker of replica `replica`."""
    prefix = f"r{replica}" if generation == 0 else f"r{replica}g{generation}"
    inbox = TalkerInbox if stage == "talker" else CodecInbox
    return (Channel.create(f"{prefix}-coord-{stage}", msg_type=inbox, capacity=ref_bytes,
                           role="writer", instance=instance),
            Channel.create(f"{prefix}-{stage}-coord", msg_type=CoordinatorInbox,
                           capacity=profile.ipc.control_ring_bytes, role="reader", instance=instance))


@dataclass
class ReplicaWorkers:
    """A replica's processes (by worker name) and their set-up pipes (kept for their lives)."""

    procs: dict[str, Any] = field(default_factory=dict)
    pipes: dict[str, Any] = field(default_factory=dict)

    def close_pipes(self) -> None:
        for conn in self.pipes.values():
            conn.close()
        self.pipes.clear()


def spawn_replica(ctx: Any, profile: Profile, variant: type[Variant], model_dir: str,
                  instance: str, replica: int, device: str, channels: ReplicaChannels,
                  clients: int, env: tuple[tuple[str, str], ...], workers: ReplicaWorkers) -> None:
    """Start the codec, then the talker of `replica` on `device`; each goes into `workers` as
    soon as it is started (so a failure half-way leaves nothing unreaped). `env`: the MPS
    daemon's client environment (empty without MPS), each stage's SM share and client priority
    added."""
    for stage in ("codec", "talker"):
        inbox, outbox = channels.of(stage)
        spawn_worker(ctx, profile, variant, model_dir, instance, replica, device, stage, inbox,
                     outbox, clients, env, workers)


def spawn_worker(ctx: Any, profile: Profile, variant: type[Variant], model_dir: str, instance: str,
                 replica: int, device: str, stage: str, inbox: Channel, outbox: Channel,
                 clients: int, env: tuple[tuple[str, str], ...], workers: ReplicaWorkers) -> None:
    """Start worker `stage` of `replica` on its coordinator channels (`inbox`: coordinator →
    worker); the spec is the same at every start of that worker but for the channels. Its
    environment: `env` with its stage's MPS settings, and its compile caches' places
    (`engine.compile_cache_dir`)."""
    mine, theirs = ctx.Pipe()
    spec = WorkerSpec(stage=stage, variant=variant, model_dir=model_dir, profile=profile,
                      device=device, instance=instance, inbox=inbox.spec(),
                      to_coord=outbox.spec(), setup=theirs, parent_pid=os.getpid(),
                      num_clients=clients if stage == "codec" else 0,
                      env=(*client_env(env, getattr(profile, stage).sm_percent,
                                       getattr(profile, stage).mps_priority),
                           *compile_cache_environment(profile).items()),
                      replica=replica, spawned_at=time.time())
    name = worker_name(stage, replica)
    proc = ctx.Process(target=codec.main if stage == "codec" else talker.main, args=(spec,),
                       name=f"mossvox-{name}", daemon=True)
    proc.start()
    theirs.close()
    workers.procs[name], workers.pipes[name] = proc, mine
    inbox.watch_peer(proc.pid)
    outbox.watch_peer(proc.pid)


async def receive_spec(pipe: Any, timeout: float, what: str) -> Any:
    """The next record a worker sends up its set-up pipe (a ring spec, or the codec's first
    `(talker → codec spec, [PCM ring specs])`); `StageNotReady` naming `what` when none comes
    within `timeout` seconds or the worker has gone."""
    from engine.coordinator import StageNotReady

    if not await asyncio.to_thread(pipe.poll, timeout):
        raise StageNotReady(f"the {what} did not come within {timeout:g} s")
    try:
        return pipe.recv()
    except EOFError:
        raise StageNotReady(f"the worker exited before sending the {what} (see its log)") from None


async def relay_specs(workers: ReplicaWorkers, replica: int, timeout: float,
                      talker_pipe: Any = None) -> list[ChannelSpec]:
    """Codec → caller: the channel specs it owns; caller → talker: the talker → codec spec (down
    `talker_pipe`, or the pipe of the talker in `workers`). Returns the codec's PCM ring specs,
    one per client."""
    from engine.coordinator import StageNotReady

    codec_name, talker_name = worker_name("codec", replica), worker_name("talker", replica)
    codec = workers.pipes[codec_name]
    if not await asyncio.to_thread(codec.poll, timeout):
        raise StageNotReady(f"the {codec_name} worker did not create its channels within "
                            f"{timeout:g} s")
    try:
        talker_codec, client_pcm = codec.recv()
    except EOFError:
        raise StageNotReady(f"the {codec_name} worker exited during start-up (see its log)"
                            ) from None
    try:
        (talker_pipe or workers.pipes[talker_name]).send(talker_codec)
    except (BrokenPipeError, OSError):
        raise StageNotReady(f"the {talker_name} worker exited during start-up (see its log)"
                            ) from None
    finally:
        close_spec(talker_codec)
    return list(client_pcm)


def close_spec(spec: ChannelSpec) -> None:
    """Close the doorbell descriptors a relayed spec holds in this process."""
    spec.ring.data_bell.close()
    spec.ring.space_bell.close()


async def join_or_kill(procs: dict[str, Any], grace_s: float = JOIN_GRACE_S) -> None:
    """Wait for the workers to exit; SIGKILL any still alive after `grace_s`; reap all."""
    for stage, proc in procs.items():
        if proc.pid is None or getattr(proc, "_closed", False):
            continue
        await asyncio.to_thread(proc.join, grace_s)
        if proc.is_alive():
            log.warning("%s worker (pid %d) did not exit: killing it", stage, proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.join, 5.0)
        proc.close() if not proc.is_alive() else None
