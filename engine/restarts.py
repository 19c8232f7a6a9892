"""Replacing a failed worker in place, with backoff and a limit.

When a worker of replica k dies, fails fatally or hangs, the coordinator fails that replica's
requests, tells the survivor (`PeerLost`) and asks `ReplicaRestarter.schedule(k, stage)`. Unless
replica k has already been restarted `engine.restart_limit` times within `engine.restart_window_s`,
a task waits the backoff (`engine.restart_backoff_s`, doubled for each earlier restart in the
window, at most `MAX_BACKOFF_S`) and replaces the dead worker alone:

- a codec: reap it, spawn a new one on new coordinator channels with the same spec; relay its
  talker → codec ring down the talker's set-up pipe and tell the talker (`Rewire`); hand its new
  PCM rings to every client; the talker keeps its model, KV cache and graphs;
- a talker: reap it, spawn a new one; the codec makes a new talker → codec ring (`Rewire`), whose
  spec goes down the new talker's set-up pipe; the codec keeps its model and graphs.

The replica serves again once the new worker (and, for a new codec, the rewired talker) said
Ready. When both workers are down (the survivor died too), or a partial restart fails, the whole
pair is restarted on new channels instead. A restart that fails counts as one and is tried again
under the same rules. Past the limit the replica stays down, and when none is left the engine
fails: `/health` answers 503 and the orchestrator's restart of the whole server is the last
resort. Every restart logs how long its phases took (spawn to relay, relay to Ready); each
worker logs its own start-up phases (load, warm-up, graphs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.replicas import worker_name
from engine.worker_procs import ReplicaWorkers, close_spec, join_or_kill, receive_spec, relay_specs
from ipc.messages import Rewire
from ipc.shm import sweep_orphans

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0


@dataclass
class RestartPolicy:
    """How often one replica (or API process slot) may be restarted, and how long to wait first.
    Pure bookkeeping."""

    limit: int          # restarts of one replica within `window_s`; 0 = never
    window_s: float
    backoff_s: float
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._recent: dict[int, deque[float]] = {}

    def next_delay(self, replica: int) -> float | None:
        """Seconds to wait before restarting `replica` now (recorded as one restart), or None
        when its restarts within the window are used up."""
        now = self.clock()
        recent = self._recent.setdefault(replica, deque())
        while recent and now - recent[0] > self.window_s:
            recent.popleft()
        if len(recent) >= self.limit:
            return None
        delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** len(recent))
        recent.append(now + delay)
        return delay

    @classmethod
    def from_profile(cls, engine_config: Any) -> RestartPolicy:
        return cls(limit=engine_config.restart_limit, window_s=engine_config.restart_window_s,
                   backoff_s=engine_config.restart_backoff_s)


class ReplicaRestarter:
    """Restarts workers of one engine (see the module docstring). Owned by the `EngineHandle`,
    which it reaches for the running processes, their set-up pipes, the spawn settings and the
    clients."""

    def __init__(self, handle: Any, policy: RestartPolicy) -> None:
        self.handle = handle
        self.policy = policy
        self.generations: dict[int, int] = {}
        self._tasks: dict[int, tuple[asyncio.Task, str | None]] = {}  # replica -> (task, stage)
        self._closed = False

    def schedule(self, replica: int, stage: str | None, reason: str) -> bool:
        """Called when worker `stage` of `replica` failed (None: both): True if a restart is on
        its way. A second worker failing while one is being replaced turns it into a restart of
        the whole pair."""
        if self._closed:
            return False
        running = self._tasks.get(replica)
        previous = None
        if running is not None:
            previous, doing = running
            if doing is None or doing == stage:
                return True  # that restart covers it (it fails and is retried if it must)
            previous.cancel()  # the new restart waits until it has cleaned up
            stage = None
        delay = self.policy.next_delay(replica)
        if delay is None:
            log.error("replica %d will not be restarted: %d restarts within %.0f s "
                      "(engine.restart_limit)", replica, self.policy.limit, self.policy.window_s)
            return False
        what = "the whole replica" if stage is None else f"its {stage}"
        log.warning("replica %d failed (%s): restarting %s in %.1f s", replica, reason, what, delay)
        task = asyncio.get_running_loop().create_task(self._restart(replica, stage, delay, previous),
                                                      name=f"restart-replica{replica}")
        self._tasks[replica] = (task, stage)
        return True

    async def _restart(self, replica: int, stage: str | None, delay: float,
                       previous: asyncio.Task | None = None) -> None:
        handle = self.handle
        try:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            await asyncio.sleep(delay)
            generation = self.generations[replica] = self.generations.get(replica, 0) + 1
            if stage is None:
                await self._restart_pair(replica, generation)
            else:
                await self._replace(replica, stage, generation)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("replica %d: restart failed", replica)
            self._done(replica)  # and the next try restarts both workers
            if not self._closed and not self.schedule(replica, None, f"restart failed: {exc}"):
                handle.coordinator.replica_lost(replica, f"its restart failed: {exc}")
            return
        self._done(replica)

    def _done(self, replica: int) -> None:
        entry = self._tasks.get(replica)
        if entry is not None and entry[0] is asyncio.current_task():
            del self._tasks[replica]

    # ---- one worker ---------------------------------------------------------------------------

    async def _replace(self, replica: int, stage: str, generation: int) -> None:
        """Replace worker `stage` of `replica`; its peer keeps serving its own state."""
        handle = self.handle
        coordinator = handle.coordinator
        name = worker_name(stage, replica)
        peer = worker_name("codec" if stage == "talker" else "talker", replica)
        old = handle.procs.pop(name, None)
        if old is not None:
            await join_or_kill({name: old}, grace_s=2.0)  # dead, or hung and SIGKILLed a moment ago
        handle.close_pipe(name)
        for channel in coordinator.detach_worker(replica, stage):
            channel.close()
        if stage == "codec":
            handle.take_client_pcm(replica)  # dropped, not closed (see `_restart_pair`)
        sweep_orphans(handle.instance)  # rings the dead worker made that nobody opened
        t0 = time.monotonic()
        to_worker, from_worker = handle.new_worker_channels(replica, stage, generation)
        workers = ReplicaWorkers()
        timeout = handle.profile.engine.ready_timeout_s
        async with handle.relay_lock(replica):
            try:
                handle.spawn_worker(replica, stage, to_worker, from_worker, workers)
                ready = coordinator.attach_worker(replica, stage, to_worker, from_worker)
            except BaseException:
                await join_or_kill(workers.procs, grace_s=0.0)
                for channel in (to_worker, from_worker):
                    channel.close()
                raise
            try:
                if stage == "codec":
                    pcm = await relay_specs(workers, replica, timeout, talker_pipe=handle.pipes[peer])
                    coordinator.rewire_survivor(replica, Rewire(stage="codec", generation=generation))
                    handle.give_client_pcm(replica, pcm)
                else:
                    coordinator.rewire_survivor(replica, Rewire(stage="talker", generation=generation))
                    spec = await receive_spec(handle.pipes[peer], timeout, f"{peer} worker's new ring")
                    try:
                        workers.pipes[name].send(spec)
                    finally:
                        close_spec(spec)
                t_relay = time.monotonic()
                async with asyncio.timeout(timeout):
                    await ready
            except BaseException:
                await join_or_kill(workers.procs, grace_s=0.0)
                handle.forget_workers(workers)
                raise  # its channels go with the next restart (or the stop)
        handle.counters.add("restarts")
        handle.counters.add(f"{stage}_restarts")
        handle.counters.add_replica(replica, "restarts")
        log.info("replica %d: %s replaced in %.1f s (spawn to its rings %.1f s, then to Ready %.1f s): "
                 "pid %d", replica, stage, time.monotonic() - t0, t_relay - t0,
                 time.monotonic() - t_relay, workers.procs[name].pid)

    # ---- both workers -------------------------------------------------------------------------

    async def _restart_pair(self, replica: int, generation: int) -> None:
        handle = self.handle
        coordinator = handle.coordinator
        old = {name: handle.procs.pop(name) for name in handle.worker_names(replica)
               if name in handle.procs}
        await join_or_kill(old, grace_s=0.0)
        for name in old:
            handle.close_pipe(name)
        for channel in coordinator.detach_replica(replica):
            channel.close()
        handle.take_client_pcm(replica)  # dropped, not closed: an in-process client's ring
        #                                  may share their doorbells (it closes them itself)
        sweep_orphans(handle.instance)  # rings the dead workers created and nobody opened
        t0 = time.monotonic()
        channels = handle.new_replica_channels(replica, generation)
        workers = ReplicaWorkers()
        attached = False
        async with handle.relay_lock(replica):
            try:
                handle.spawn_replica(replica, channels, workers)
                ready = coordinator.attach_replica(replica, channels)
                attached = True
                timeout = handle.profile.engine.ready_timeout_s
                pcm = await relay_specs(workers, replica, timeout)
                handle.give_client_pcm(replica, pcm)
                async with asyncio.timeout(timeout):
                    await ready
            except BaseException:
                await join_or_kill(workers.procs, grace_s=0.0)
                handle.forget_workers(workers)
                if not attached:  # else the next restart (or stop) closes them with the replica
                    for channel in channels.all():
                        channel.close()
                raise
        handle.counters.add("restarts")
        handle.counters.add_replica(replica, "restarts")
        log.info("replica %d restarted in %.1f s: talker pid %d, codec pid %d", replica,
                 time.monotonic() - t0, *(workers.procs[n].pid for n in handle.worker_names(replica)))

    async def close(self) -> None:
        """Cancel restarts in progress (the engine is stopping)."""
        self._closed = True
        tasks = [task for task, _ in self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
