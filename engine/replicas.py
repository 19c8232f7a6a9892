"""Replicas as the coordinator sees them: one talker+codec pair each, and where a request goes.

A replica is one talker worker and one codec worker (on one GPU, or a group of
`talker.tensor_parallel` GPUs), with their four channels to the coordinator. The coordinator
routes each new request to the live replica with the most headroom, keeps it there (its abort
goes to that replica's workers) and, when a replica's worker dies, fails only that replica's
requests and reference-encode jobs, and replaces only the worker that died (`down`). No I/O
here beyond the replica's outboxes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from engine.outbox import Outbox
from ipc.channel import Channel
from ipc.messages import Ready


@dataclass(frozen=True)
class ReplicaChannels:
    """The coordinator's ends of one replica's channels."""

    to_talker: Channel
    from_talker: Channel
    to_codec: Channel
    from_codec: Channel

    def all(self) -> list[Channel]:
        return [self.to_talker, self.from_talker, self.to_codec, self.from_codec]

    def of(self, stage: str) -> tuple[Channel, Channel]:
        """(to, from) the coordinator's channels to one worker."""
        return (self.to_talker, self.from_talker) if stage == "talker" else (self.to_codec, self.from_codec)

    def with_stage(self, stage: str, to_worker: Channel, from_worker: Channel) -> ReplicaChannels:
        """These channels with one worker's pair replaced (that worker was restarted)."""
        if stage == "talker":
            return replace(self, to_talker=to_worker, from_talker=from_worker)
        return replace(self, to_codec=to_worker, from_codec=from_worker)


@dataclass
class Replica:
    """One talker+codec pair's coordinator-side state."""

    index: int
    channels: ReplicaChannels
    capacity: int                    # requests it runs at once (admission.max_running)
    talker: Outbox = field(init=False)
    codec: Outbox = field(init=False)
    up: bool = True
    running: set[int] = field(default_factory=set)  # rids dispatched here, not yet closed
    jobs: set[int] = field(default_factory=set)     # reference-encode jobs sent to its codec
    slots: dict[str, int] = field(default_factory=lambda: {"talker": 0, "codec": 0})
    capacities: dict[str, int] = field(default_factory=lambda: {"talker": 0, "codec": 0})
    ready: dict[str, asyncio.Future[Ready]] = field(default_factory=dict)
    generation: int = 0              # 0 at launch, n after its n-th restart
    generations: dict[str, int] = field(default_factory=lambda: {"talker": 0, "codec": 0})
    #                                  per worker: records of an older one are stale
    down: set[str] = field(default_factory=set)  # workers dead or hung, being replaced
    down_since: float = 0.0          # when the replica went out of service
    pids: dict[str, int] = field(default_factory=dict)  # from each worker's Ready
    beats: dict[str, tuple[int, float]] = field(default_factory=dict)  # last beat count, seen when
    detached: bool = False           # replaced by a restart: its channels are closed

    def __post_init__(self) -> None:
        self.talker = Outbox(self.channels.to_talker, f"replica{self.index}-talker")
        self.codec = Outbox(self.channels.to_codec, f"replica{self.index}-codec")

    @property
    def headroom(self) -> int:
        """Requests it can still take: capacity minus those running or waiting in its talker."""
        return self.capacity - len(self.running)

    def outbox(self, stage: str) -> Outbox:
        return self.talker if stage == "talker" else self.codec

    def rewire(self, stage: str, to_worker: Channel, from_worker: Channel) -> None:
        """Worker `stage` was replaced: its new channels, a new outbox, a new generation."""
        self.outbox(stage).close()
        self.channels = self.channels.with_stage(stage, to_worker, from_worker)
        box = Outbox(to_worker, f"replica{self.index}-{stage}")
        if stage == "talker":
            self.talker = box
        else:
            self.codec = box
        self.generations[stage] += 1

    def close(self) -> None:
        self.talker.close()
        self.codec.close()


class ReplicaSet:
    """All replicas; picks where new work goes."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas

    def __iter__(self):
        return iter(self.replicas)

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    def __len__(self) -> int:
        return len(self.replicas)

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.up]

    @property
    def num_up(self) -> int:
        return sum(r.up for r in self.replicas)

    @property
    def live_capacity(self) -> int:
        """Requests the live replicas run at once together."""
        return sum(r.capacity for r in self.replicas if r.up)

    def pick(self) -> Replica | None:
        """The live replica with the most headroom (lowest index on ties); None when every live
        replica is full or none is left."""
        best = max(self.live(), key=lambda r: (r.headroom, -r.index), default=None)
        return best if best is not None and best.headroom > 0 else None

    def pick_encoder(self) -> Replica | None:
        """The live replica whose codec has the least work (requests + encode jobs)."""
        return min(self.live(), key=lambda r: (len(r.running) + len(r.jobs), r.index),
                   default=None)

    def owner_of_job(self, job: int) -> Replica | None:
        return next((r for r in self.replicas if job in r.jobs), None)


def worker_name(stage: str, replica: int) -> str:
    """A worker's name in messages, `EngineHandle.pids` and `wait_ready`: `talker` / `codec` for
    replica 0 (as with one replica), `talker.1` / `codec.1` for replica 1, ..."""
    return stage if replica == 0 else f"{stage}.{replica}"
