"""Restarting a failed replica in place, with backoff and a limit.

When a worker of replica k dies (or reports a fatal error) the coordinator fails that replica's
requests and asks `ReplicaRestarter.schedule(k)`. Unless replica k has already been restarted
`engine.restart_limit` times within `engine.restart_window_s`, a task waits the backoff
(`engine.restart_backoff_s`, doubled for each earlier restart in the window, at most
`MAX_BACKOFF_S`), reaps the old pair (the survivor was told to stop), starts a new pair on new
channels, hands the new codec's PCM rings to every client, and waits for both workers' Ready; the
coordinator puts the replica back in service on them (`/ready` turns 200 again when it was the
only one). A restart that fails counts as one and is tried again under the same rules. Past the
limit the replica stays down, and when none is left the engine fails: `/health` answers 503 and
the orchestrator's restart of the whole server is the last resort.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.worker_procs import ReplicaWorkers, join_or_kill, relay_specs
from ipc.shm import sweep_orphans

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0


@dataclass
class RestartPolicy:
    """How often one replica may be restarted, and how long to wait first. Pure bookkeeping."""

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
    """Restarts replicas of one engine (see the module docstring). Owned by the `EngineHandle`,
    which it reaches for the running processes, the spawn settings and the clients."""

    def __init__(self, handle: Any, policy: RestartPolicy) -> None:
        self.handle = handle
        self.policy = policy
        self.generations: dict[int, int] = {}
        self._tasks: dict[int, asyncio.Task] = {}
        self._closed = False

    def schedule(self, replica: int, reason: str) -> bool:
        """Called when `replica` failed: True if a restart is on its way."""
        if self._closed or replica in self._tasks:
            return not self._closed
        delay = self.policy.next_delay(replica)
        if delay is None:
            log.error("replica %d will not be restarted: %d restarts within %.0f s "
                      "(engine.restart_limit)", replica, self.policy.limit, self.policy.window_s)
            return False
        log.warning("replica %d failed (%s): restarting it in %.1f s", replica, reason, delay)
        task = asyncio.get_running_loop().create_task(self._restart(replica, delay),
                                                      name=f"restart-replica{replica}")
        self._tasks[replica] = task
        return True

    async def _restart(self, replica: int, delay: float) -> None:
        handle = self.handle
        coordinator = handle.coordinator
        try:
            await asyncio.sleep(delay)
            old = {name: handle.procs.pop(name) for name in handle.worker_names(replica)
                   if name in handle.procs}
            await join_or_kill(old)
            for channel in coordinator.detach_replica(replica):
                channel.close()
            handle.take_client_pcm(replica)  # dropped, not closed: an in-process client's ring
            #                                  may share their doorbells (it closes them itself)
            sweep_orphans(handle.instance)  # rings the dead workers created and nobody opened
            generation = self.generations[replica] = self.generations.get(replica, 0) + 1
            await self._start(replica, generation)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("replica %d: restart failed", replica)
            self._tasks.pop(replica, None)
            if not self._closed and not self.schedule(replica, f"restart failed: {exc}"):
                coordinator.replica_lost(replica, f"its restart failed: {exc}")
            return
        self._tasks.pop(replica, None)

    async def _start(self, replica: int, generation: int) -> None:
        handle = self.handle
        t0 = time.monotonic()
        channels = handle.new_replica_channels(replica, generation)
        workers = ReplicaWorkers()
        attached = False
        try:
            handle.spawn_replica(replica, channels, workers)
            ready = handle.coordinator.attach_replica(replica, channels)
            attached = True
            timeout = handle.profile.engine.ready_timeout_s
            pcm = await relay_specs(workers, replica, timeout)
            handle.give_client_pcm(replica, pcm)
            async with asyncio.timeout(timeout):
                await ready
        except BaseException:
            await join_or_kill(workers.procs, grace_s=0.0)
            for name in workers.procs:
                handle.procs.pop(name, None)
            if not attached:  # else the next restart (or stop) closes them with the replica
                for channel in channels.all():
                    channel.close()
            raise
        finally:
            workers.close_pipes()
        handle.counters.add("restarts")
        handle.counters.add_replica(replica, "restarts")
        log.info("replica %d restarted in %.1f s: talker pid %d, codec pid %d", replica,
                 time.monotonic() - t0, *(workers.procs[n].pid for n in handle.worker_names(replica)))

    async def close(self) -> None:
        """Cancel restarts in progress (the engine is stopping)."""
        self._closed = True
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
