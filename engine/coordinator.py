"""The coordinator: request table, admission, deadlines, cancellation, failure handling, counters.

Event-driven only: one reader task per inbound channel sleeps on that channel's doorbell (and its
peer's pidfd); handlers are plain functions that never await, and every send goes through a
never-blocking `Outbox`. The only timers are per-request deadlines (`loop.call_later`), while
the ring gauge reads non-zero its 50 ms re-read, and the liveness check: every quarter of
`engine.liveness_timeout_s` it reads each serving worker's beat word (`Ring.beats`); a worker
whose beat stood still for the whole timeout is hung (stopped, or stuck): it is SIGKILLed and
counted lost at once, like a death its pidfd reports.

A request's life: `Submit` → run now (forwarded with its prompt to the talker of the live replica
with the most headroom, `engine.replicas`) or queue (one queue for all replicas; also while a
playing stream runs low on buffered audio, `engine.playout_gate`), or a typed
`Rejected` → its replica's codec's final `ChunkDone` closes it and frees its place. An abort
(client gone), a deadline or a per-request error sends `Abort` to both workers of its replica; the
request still closes on the codec's final record, which every request gets, so counts cannot
drift. A dead worker (`PeerGone` on its channel, a fatal `StageError`, or no beat) fails every
request of its replica at once (`Failed`, reason "worker_lost": the API ends them cleanly), takes
the replica out of service and tells the surviving worker (`PeerLost`), which drops those
requests and keeps its model and caches; the engine stays healthy and ready while one replica is
up. `on_worker_failed` (the launcher's `engine.restarts.ReplicaRestarter`) replaces the dead
worker alone: `detach_worker` / `attach_worker` swap its channels, the survivor is rewired to the
new one (`Rewire`), and the Ready records put the replica back in service (`detach_replica` /
`attach_replica` do the same for a whole replica, when both died). The engine fails only when
no replica is up and none is being restarted. An API process that dies is replaced by the server
(`swap_client`: its requests are aborted, new channels take the slot).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from engine.admission import Admission, Verdict
from engine.counters import CounterBlock
from engine.outbox import Outbox
from engine.playout_gate import PlayoutGate
from engine.replicas import Replica, ReplicaChannels, ReplicaSet, worker_name
from engine.request_table import Phase, Request, RequestTable
from engine.shutdown import EngineState, Lifecycle
from ipc.channel import Channel
from ipc.errors import EndOfStream, PeerGone, RingClosed
from ipc.messages import (Abort, ChunkDone, DecodeBatch, EncodeDone, EncodeRequest, Failed, Feed,
                          MemoryReport, PeerLost, Ready, Rejected, Rewire, Shutdown, Slots, StageError,
                          Submit, TalkerStep)
from profiles import Profile

log = logging.getLogger(__name__)

GIB = 1 << 30


class UnknownMessage(RuntimeError):
    """A record the coordinator does not handle reached it."""


class StageNotReady(RuntimeError):
    """A worker did not send Ready in time (or died first)."""


class Coordinator:
    """Owns the request table; wired to every replica's workers and to every client's channels."""

    def __init__(self, profile: Profile, *, replicas: list[ReplicaChannels],
                 to_clients: list[Channel], from_clients: list[Channel], counters: CounterBlock,
                 sample_rate: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.profile = profile
        self.sample_rate = sample_rate
        self.clock = clock
        self.table = RequestTable()
        a = profile.admission
        self.replicas = ReplicaSet([Replica(k, ch, a.max_running) for k, ch in enumerate(replicas)])
        self.admission = Admission(self.replicas.live_capacity, a.max_queued, a.retry_after_s)
        self.gate = PlayoutGate(a.min_lead_s, a.lead_settle_s)
        self.lifecycle = Lifecycle(profile.engine.shutdown)
        self.counters = counters
        self.clients = [Outbox(ch, f"client{i}") for i, ch in enumerate(to_clients)]
        self._to_clients, self._from_clients = list(to_clients), list(from_clients)
        self._client_generations = [0] * len(to_clients)
        self._jobs: dict[int, int] = {}  # reference-encode job -> client
        counters["replicas"] = counters["replicas_up"] = len(replicas)
        for k in range(len(replicas)):
            counters.set_replica(k, "up", 1)
        # (replica, dead worker or None for both, reason) -> True: it is being restarted
        self.on_worker_failed: Callable[[int, str | None, str], bool] | None = None
        self._restarting: set[int] = set()
        self._client_tasks: dict[int, asyncio.Task] = {}
        self._worker_tasks: dict[tuple[int, str], asyncio.Task] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._ring_recheck: asyncio.TimerHandle | None = None
        self._liveness: asyncio.TimerHandle | None = None

    # ---- running -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start one reader task per inbound channel on the running loop, and the liveness
        check."""
        for replica in self.replicas:
            self._start_replica(replica)
        for i in range(len(self._from_clients)):
            self._start_client_reader(i)
        if self.profile.engine.liveness_timeout_s > 0:
            self._liveness = asyncio.get_running_loop().call_later(
                self.profile.engine.liveness_timeout_s / 4, self._check_liveness)

    def _start_client_reader(self, index: int) -> None:
        source = ("client", index, self._client_generations[index])
        self._client_tasks[index] = asyncio.get_running_loop().create_task(
            self._read(self._from_clients[index], source), name=f"coordinator-read-client{index}")

    def _start_replica(self, replica: Replica) -> None:
        """Ready futures and reader tasks for `replica`'s (current) workers."""
        loop = asyncio.get_running_loop()
        replica.ready = {s: loop.create_future() for s in ("talker", "codec")}
        for stage in ("talker", "codec"):
            self._start_worker_reader(replica, stage)

    def _start_worker_reader(self, replica: Replica, stage: str) -> None:
        k = replica.index
        source = (stage, k, replica.generations[stage])
        self._worker_tasks[(k, stage)] = asyncio.get_running_loop().create_task(
            self._read(replica.channels.of(stage)[1], source), name=f"coordinator-read-{stage}{k}")

    def detach_worker(self, index: int, stage: str) -> list[Channel]:
        """Stop talking to replica `index`'s dead worker `stage`; returns its two channels to
        close."""
        replica = self.replicas[index]
        task = self._worker_tasks.pop((index, stage), None)
        if task is not None:
            task.cancel()
        replica.outbox(stage).close()
        replica.beats.pop(stage, None)
        return list(replica.channels.of(stage))

    def attach_worker(self, index: int, stage: str, to_worker: Channel,
                      from_worker: Channel) -> Awaitable[Any]:
        """Worker `stage` of replica `index` restarted on these channels: the returned awaitable
        completes once it said Ready, and (a new codec) the talker too, once rewired
        (`rewire_survivor`); then the replica serves again."""
        replica = self.replicas[index]
        replica.rewire(stage, to_worker, from_worker)
        loop = asyncio.get_running_loop()
        for s in ("talker", "codec") if stage == "codec" else ("talker",):
            old = replica.ready.get(s)
            if old is not None and not old.done():
                old.cancel()
            replica.ready[s] = loop.create_future()
        self._start_worker_reader(replica, stage)
        return asyncio.gather(*(f for f in replica.ready.values() if not f.done()))

    def rewire_survivor(self, index: int, rewire: Rewire) -> None:
        """Tell replica `index`'s surviving worker to attach its replaced peer (`Rewire`): the
        talker when the codec was replaced, the codec for a new talker or API process."""
        replica = self.replicas[index]
        (replica.codec if rewire.stage in ("talker", "client") else replica.talker).put(rewire)

    def detach_replica(self, index: int) -> list[Channel]:
        """Stop talking to replica `index`'s (dead) workers; returns its channels to close."""
        replica = self.replicas[index]
        for stage in ("talker", "codec"):
            task = self._worker_tasks.pop((index, stage), None)
            if task is not None:
                task.cancel()
        replica.close()
        for fut in replica.ready.values():
            if not fut.done():
                fut.cancel()
        if replica.detached:
            return []
        replica.detached = True
        return replica.channels.all()

    def attach_replica(self, index: int, channels: ReplicaChannels) -> Awaitable[Any]:
        """Replica `index` restarted on `channels`: out of service until both workers say Ready
        (the returned awaitable); then it serves again."""
        old = self.replicas[index]
        new = Replica(index, channels, old.capacity, up=False, generation=old.generation + 1,
                      generations={s: g + 1 for s, g in old.generations.items()},
                      down=set(old.down) or {"talker", "codec"}, down_since=old.down_since)
        self.replicas.replicas[index] = new
        self._start_replica(new)
        return asyncio.gather(*new.ready.values())

    def replica_lost(self, index: int, reason: str) -> None:
        """Replica `index` will not be restarted; with none left up, the engine fails."""
        self._restarting.discard(index)
        if self.replicas.num_up == 0 and not self._restarting and self.lifecycle.healthy:
            self._engine_failed(f"replica {index}: {reason}")

    async def wait_ready(self, timeout: float) -> dict[str, Ready]:
        """Every worker's Ready record (keys `talker`, `codec` for replica 0, `talker.k`,
        `codec.k` for replica k); `StageNotReady` naming the stage that did not come up."""
        futures = {worker_name(stage, r.index): fut
                   for r in self.replicas for stage, fut in r.ready.items()}
        try:
            async with asyncio.timeout(timeout):  # the first worker to fail fails the wait at once
                await asyncio.wait(futures.values(), return_when=asyncio.FIRST_EXCEPTION)
                return {key: fut.result() for key, fut in futures.items()}
        except TimeoutError:
            missing = [key for key, f in futures.items() if not f.done()]
            raise StageNotReady(
                f"the {' and '.join(missing)} worker did not send Ready within {timeout:g} s "
                f"(raise engine.ready_timeout_s if model loading is just slow)") from None

    async def _read(self, channel: Channel, source: tuple[str, int, int]) -> None:
        """Sleep until records arrive, handle every waiting one, then update the ring gauge."""
        while True:
            try:
                rec = await channel.recv_async()
            except (PeerGone, EndOfStream, RingClosed) as exc:
                self._on_peer_gone(source, exc)
                return
            t0 = time.perf_counter()
            while rec is not None:
                try:
                    self._handle(source, rec.msg, rec)
                except Exception:  # a handler bug must not silently stop this reader
                    log.exception("coordinator: handling %r from %s failed", rec.msg, source)
                finally:
                    rec.release()
                try:
                    rec = channel.try_recv()
                except (PeerGone, EndOfStream, RingClosed):
                    rec = None  # the next recv_async reports it
            self._update_ring_gauge()
            self.counters.add("coordinator_busy_s", time.perf_counter() - t0)

    def _handle(self, source: tuple[str, int, int], msg: Any, rec: Any) -> None:
        replica = self.replicas[source[1]] if source[0] != "client" else None
        if replica is not None and replica.generations[source[0]] != source[2]:
            return  # from a worker that has since been replaced
        match msg:
            case Submit():
                self._on_submit(msg, rec)
            case Feed():
                self._on_feed(msg, rec)
            case Abort(rid=rid):
                self._abort(rid, notify=None)
            case ChunkDone():
                self._on_chunk_done(msg)
            case Slots(stage=stage, in_use=n) if replica is not None and replica.up:
                replica.slots[stage] = n
                self.counters.set_replica(replica.index, f"{stage}_slots", n)
                self.counters[f"{stage}_slots"] = sum(r.slots[stage] for r in self.replicas)
            case Slots():
                pass  # a replica already taken out of service
            case DecodeBatch(size=size, waited_s=waited, emit_s=emit_s, decode_s=decode_s):
                self.counters.count_batch(size, waited)
                self.counters.add("codec_emit_s", emit_s)
                self.counters.add("codec_decode_s", decode_s)
            case TalkerStep(batch=batch, steps=steps, step_s=step_s):
                self.counters.count_talker_step(batch, steps)
                self.counters.add("talker_step_s", step_s)
                self.counters.add("talker_prompt_rows", msg.prompt_rows)
                self.counters.add("talker_cached_rows", msg.cached_rows)
            case EncodeRequest():
                self._on_encode(msg, rec)
            case EncodeDone(job=job):
                self._jobs.pop(job, None)
                if replica is not None:
                    replica.jobs.discard(job)
                self._update_gauges()
            case StageError(rid=None, stage=stage, message=message) if replica is not None:
                fut = replica.ready.get(stage)
                if fut is not None and not fut.done():  # start-up failed: say why (e.g. its memory plan)
                    fut.set_exception(StageNotReady(
                        f"the {worker_name(stage, replica.index)} worker failed before Ready: {message}"))
                self._worker_lost(replica, stage, f"the {worker_name(stage, replica.index)} "
                                                  f"worker failed: {message}")
            case StageError(rid=rid, message=message):
                self._abort(rid, notify=f"request failed in the {msg.stage}: {message}")
            case Ready(stage=stage) if replica is not None:
                fut = replica.ready.get(stage)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                replica.pids[stage] = msg.pid
                replica.beats[stage] = (replica.channels.of(stage)[1].beats, self.clock())
                replica.capacities[stage] = msg.capacity
                if msg.memory is not None:
                    self._record_memory(replica.index, stage, msg.memory)
                if msg.max_prompt_rows:  # the smallest limit of any replica's talker
                    known = self.counters["max_prompt_rows"]
                    self.counters["max_prompt_rows"] = min(known or msg.max_prompt_rows, msg.max_prompt_rows)
                if not replica.up and all(f.done() and not f.cancelled() and f.exception() is None
                                          for f in replica.ready.values()):
                    self._replica_back(replica)  # both workers said Ready (none died first)
                self._update_capacity()
                self._update_ready()
            case _:
                raise UnknownMessage(f"{msg!r} from {source}")

    # ---- requests ------------------------------------------------------------------------------

    def _on_submit(self, submit: Submit, rec: Any) -> None:
        client = self.clients[submit.client]
        self.counters.add("submitted")
        if not self.lifecycle.healthy:
            self.counters.add("failed")
            client.put(Failed(rid=submit.rid, message=f"engine failed: {self.lifecycle.reason}",
                              reason="engine_failed"))
            return
        if not self.lifecycle.accepting:
            self._reject(submit, "engine is shutting down")
            return
        size = 0 if rec.payload is None else rec.payload.nbytes
        if size > self.replicas[0].talker.channel.max_payload_size:  # equal on every replica
            self.counters.add("failed")
            client.put(Failed(rid=submit.rid, message=f"prompt of {size} bytes exceeds the "
                                                      f"talker ring's largest record", reason="too_large"))
            return
        verdict = self.admission.decide(self.table.num_running, self.table.num_queued,
                                        hold=self._held())
        if verdict is Verdict.REJECT:
            self._reject(submit, f"queue full ({self.table.num_queued} waiting)")
            return
        req = Request(submit=submit, prompt=None, t_submit=self.clock(),
                      input_open=submit.open_input)
        timeout = submit.timeout_s or self.profile.admission.request_timeout_s
        req.deadline = asyncio.get_running_loop().call_later(timeout, self._on_deadline, submit.rid)
        replica = self.replicas.pick() if verdict is Verdict.RUN else None
        if replica is not None:
            self._start(req, replica, rec.payload)
        else:
            req.prompt = rec.array("int64").copy()  # [S * (1 + n_vq)] flat; the talker reshapes
            self.table.enqueue(req)
        self._update_gauges()

    def _on_feed(self, feed: Feed, rec: Any) -> None:
        """More input for an open request: to its talker, or held until it is dispatched."""
        req = self.table.get(feed.rid)
        if req is None or req.phase is Phase.ABORTING:
            return  # ended or ending: nothing reads it any more
        if feed.final:
            req.input_open = False
        if req.phase is Phase.QUEUED:
            rows = None if rec.payload is None else rec.array("int64").copy()
            req.feeds.append((feed, rows))
        else:
            self.replicas[req.replica].talker.put(feed, rec.payload)

    def _reject(self, submit: Submit, reason: str) -> None:
        self.counters.add("rejected")
        retry = self.admission.retry_after_s(self.table.num_queued)
        self.clients[submit.client].put(Rejected(rid=submit.rid, reason=reason, retry_after_s=retry))

    def _dispatch_queued(self) -> None:
        while self.table.num_queued and self.lifecycle.healthy and self.admission.may_dispatch(
                self.table.num_running, hold=self._held()):
            req, replica = self.table.next_queued(), self.replicas.pick()
            if req is None or replica is None:
                return
            self._start(req, replica, req.prompt)

    def _held(self) -> bool:
        """The playout gate holds new work now (`engine.playout_gate`); kept in the
        `admission_held` gauge, each start of a hold counted in `admission_holds`."""
        held = self.gate.holding(self.clock())
        if held != bool(self.counters["admission_held"]):
            self.counters["admission_held"] = int(held)
            if held:
                self.counters.add("admission_holds")
        return held

    def _start(self, req: Request, replica: Replica, prompt: Any) -> None:
        """Dispatch `req` to `replica`'s talker; it stays on that replica until it closes."""
        self.table.start(req, self.clock())
        req.replica = replica.index
        replica.running.add(req.rid)
        self.counters.add_replica(replica.index, "dispatched")
        replica.talker.put(req.submit, prompt)
        for feed, rows in req.feeds:  # input that arrived while it was queued, in order
            replica.talker.put(feed, rows)
        req.feeds.clear()

    def _abort(self, rid: int, notify: str | None, reason: str = "error") -> None:
        """Cancel `rid`; with `notify`, its client gets `Failed(notify, reason)` (deadline,
        error, shutdown)."""
        req = self.table.get(rid)
        if req is None:
            return
        if notify is not None:
            self.counters.add("failed")
            if req.replica >= 0:
                self.counters.add_replica(req.replica, "failed")
            self.clients[req.client].put(Failed(rid=rid, message=notify, reason=reason))
        else:
            self.counters.add("aborted")
        self.gate.forget(rid)
        if req.phase is Phase.QUEUED:
            self.table.remove(rid)
            self._update_gauges()
        elif req.phase is Phase.RUNNING:
            req.phase = Phase.ABORTING
            replica = self.replicas[req.replica]
            replica.talker.put(Abort(rid=rid))
            replica.codec.put(Abort(rid=rid))

    def _on_deadline(self, rid: int) -> None:
        req = self.table.get(rid)
        if req is not None:
            req.deadline = None
            self._abort(rid, notify="request deadline exceeded "
                                    "(admission.request_timeout_s)", reason="deadline")

    def _on_chunk_done(self, done: ChunkDone) -> None:
        req = self.table.get(done.rid)
        if req is None:
            return
        now = self.clock()
        if done.samples:
            req.chunks += 1
            req.samples += done.samples
            self.counters.add("chunks")
            self.counters.add("audio_s", done.samples / self.sample_rate)
            if req.t_first_chunk is None:
                req.t_first_chunk = now
            if req.phase is Phase.RUNNING and not req.input_open:
                self.gate.on_audio(done.rid, req.t_first_chunk, req.samples / self.sample_rate)
        if not done.final:
            if self.gate.enabled and self.table.num_queued:
                self._dispatch_queued()  # the chunk may have lifted the stream that held them
                self._update_gauges()
            return
        self.gate.forget(done.rid)
        self.table.remove(done.rid)
        self.replicas[req.replica].running.discard(done.rid)
        if req.phase is Phase.RUNNING and done.finish_reason in ("stop", "length"):
            self.counters.add(f"finished_{done.finish_reason}")
        if req.t_dispatch is not None:
            self.admission.record_service_time(now - req.t_dispatch)
        self._dispatch_queued()
        self._update_gauges()

    def _on_encode(self, job: EncodeRequest, rec: Any) -> None:
        replica = self.replicas.pick_encoder()
        if not self.lifecycle.healthy or replica is None:
            reason = self.lifecycle.reason if not self.lifecycle.healthy else "no replica is up"
            self.clients[job.client].put(Failed(rid=job.job, message=f"engine failed: {reason}",
                                                reason="engine_failed" if not self.lifecycle.healthy
                                                else "worker_lost"))
            return
        self._jobs[job.job] = job.client
        replica.jobs.add(job.job)
        replica.codec.put(job, rec.payload)
        self._update_gauges()

    # ---- failure and shutdown ------------------------------------------------------------------

    def _on_peer_gone(self, source: tuple[str, int, int], exc: BaseException) -> None:
        stage, index, generation = source
        if stage in ("talker", "codec"):
            replica = self.replicas[index]
            if replica.generations[stage] != generation:
                return  # a replaced worker's channel
            if self.lifecycle.state is not EngineState.STOPPED:
                self._worker_lost(replica, stage, f"the {worker_name(stage, index)} worker died ({exc})")
            fut = replica.ready.get(stage)
            if fut is not None and not fut.done():
                fut.set_exception(StageNotReady(
                    f"the {worker_name(stage, index)} worker exited before Ready"))
            return
        if generation != self._client_generations[index]:
            return  # a replaced API process's channel
        self._client_gone(index, str(exc))

    def _client_gone(self, index: int, why: str) -> None:
        """API process `index` went away: abort its requests (their audio has nobody to go to)."""
        mine = [req for req in self.table.all() if req.client == index]
        if not mine:  # a client closing with nothing open (a clean shutdown, `synth`) is no news
            log.debug("client %d closed (%s)", index, why)
            return
        report = log.warning if self.lifecycle.accepting else log.info
        report("client %d went away (%s) with %d open request(s): aborting them", index, why, len(mine))
        for req in mine:
            self._abort(req.rid, notify=None)

    def swap_client(self, index: int, to_client: Channel, from_client: Channel) -> list[Channel]:
        """API process slot `index` gets a new process on these channels (its old one died):
        the old one's requests are aborted, its reader stops; returns the old channels to close."""
        task = self._client_tasks.pop(index, None)
        if task is not None:
            task.cancel()
        self.clients[index].close()
        self._client_gone(index, "replaced")
        old = [self._to_clients[index], self._from_clients[index]]
        self._to_clients[index], self._from_clients[index] = to_client, from_client
        self.clients[index] = Outbox(to_client, f"client{index}")
        self._client_generations[index] += 1
        self._start_client_reader(index)
        return old

    def _worker_lost(self, replica: Replica, stage: str, reason: str) -> None:
        """Worker `stage` of `replica` is gone (died, failed, or hung and killed): the replica's
        requests fail now (reason "worker_lost"), and its encode jobs when the codec is the one,
        new work goes to the other replicas. The restarter replaces the dead worker alone while
        the survivor, told by `PeerLost`, keeps its state; with restarts off or used up the
        survivor is stopped. With no replica left up or coming back, the engine is unhealthy."""
        if not self.lifecycle.healthy or stage in replica.down:
            return
        if replica.up:
            replica.down_since = self.clock()
        replica.up = False
        replica.down.add(stage)
        replica.beats.pop(stage, None)
        mine = [req for req in self.table.active() if req.replica == replica.index]
        jobs = list(replica.jobs) if stage == "codec" else []
        log.error("replica %d: %s: failing its %d requests and %d encode jobs (%d replica(s) "
                  "up)", replica.index, reason, len(mine), len(jobs), self.replicas.num_up)
        for req in mine:
            self.table.remove(req.rid)
            self.gate.forget(req.rid)
            self.counters.add("failed")
            self.counters.add_replica(replica.index, "failed")
            self.clients[req.client].put(Failed(rid=req.rid, message=reason, reason="worker_lost"))
        for job in jobs:
            client = self._jobs.pop(job, None)
            if client is not None:
                self.clients[client].put(Failed(rid=job, message=reason, reason="worker_lost"))
            replica.jobs.discard(job)
        replica.running.clear()
        replica.slots = {"talker": 0, "codec": 0}
        for key in ("up", "running", "talker_slots", "codec_slots"):
            self.counters.set_replica(replica.index, key, 0)
        for s in ("talker", "codec"):
            self.counters[f"{s}_slots"] = sum(r.slots[s] for r in self.replicas)
        self.counters["replicas_up"] = self.replicas.num_up
        self.admission.max_running = max(1, self.replicas.live_capacity)
        self._update_capacity()
        restarting = (self.lifecycle.accepting and self.on_worker_failed is not None
                      and self.on_worker_failed(replica.index, stage, reason))
        survivor = "codec" if stage == "talker" else "talker"
        if survivor not in replica.down:  # keeps its model and caches for the replacement, or stops
            replica.outbox(survivor).put(PeerLost(stage=stage) if restarting else Shutdown(drain=False))
        if restarting:
            self._restarting.add(replica.index)
        else:
            self._restarting.discard(replica.index)
        if self.replicas.num_up == 0 and not self._restarting:
            self._engine_failed(reason)
        else:
            self._dispatch_queued()
        self._update_ready()
        self._update_gauges()

    def _replica_back(self, replica: Replica) -> None:
        """A restarted replica's workers said Ready: it serves again."""
        self._restarting.discard(replica.index)
        replica.up = True
        replica.down.clear()
        took = self.clock() - replica.down_since
        self.counters["restart_last_s"] = took
        self.counters.set_replica(replica.index, "up", 1)
        self.counters["replicas_up"] = self.replicas.num_up
        self.admission.max_running = max(1, self.replicas.live_capacity)
        log.info("replica %d is back in service %.1f s after it went out (%d of %d up)",
                 replica.index, took, self.replicas.num_up, len(self.replicas))
        self._dispatch_queued()
        self._update_gauges()

    def _check_liveness(self) -> None:
        """Every quarter of `engine.liveness_timeout_s`: a serving worker whose beat word did not
        move for the whole timeout is hung; it is killed and replaced like a dead one."""
        timeout = self.profile.engine.liveness_timeout_s
        now = self.clock()
        for replica in self.replicas:
            for stage in ("talker", "codec"):
                seen = replica.beats.get(stage)
                channel = replica.channels.of(stage)[1]
                if seen is None or stage in replica.down or replica.detached or channel.closed:
                    continue
                beats = channel.beats
                if beats != seen[0]:
                    replica.beats[stage] = (beats, now)
                elif now - seen[1] > timeout:
                    self._kill_hung(replica, stage, now - seen[1])
        self._liveness = asyncio.get_running_loop().call_later(timeout / 4, self._check_liveness)

    def _kill_hung(self, replica: Replica, stage: str, still_s: float) -> None:
        """Kill a hung worker and count it lost at once: the replica stops serving (and `/ready`
        says so) now, not when its pidfd's report of the death is read."""
        pid, name = replica.pids.get(stage), worker_name(stage, replica.index)
        log.error("the %s worker (pid %s) has not beaten for %.1f s (engine.liveness_timeout_s): "
                  "it hangs; killing it to replace it", name, pid, still_s)
        self.counters.add("hung_workers")
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._worker_lost(replica, stage, f"the {name} worker hung ({still_s:.1f} s without a beat)")

    def _engine_failed(self, reason: str) -> None:
        """No replica is left: every request and encode job fails now; the engine is unhealthy."""
        log.error("no replica left: the engine has failed (%s)", reason)
        self.lifecycle.fail(reason)
        self.counters["healthy"] = 0
        self.counters["ready"] = 0
        for req in self.table.all():
            self.table.remove(req.rid)
            self.gate.forget(req.rid)
            self.counters.add("failed")
            self.clients[req.client].put(Failed(rid=req.rid, message=reason, reason="engine_failed"))
        for job, client in self._jobs.items():
            self.clients[client].put(Failed(rid=job, message=reason, reason="engine_failed"))
        self._jobs.clear()

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """running → draining → stopped: drain or abort (profile), then tell the workers to stop."""
        self.lifecycle.request_stop()
        drain = self.lifecycle.mode == "drain"
        budget = self.profile.engine.drain_timeout_s if timeout_s is None else timeout_s
        if drain:
            await self._wait_idle(budget)
        for req in self.table.all():
            self._abort(req.rid, notify="engine is shutting down", reason="shutdown")
        await self._wait_idle(min(budget, 5.0) if drain else budget)
        for replica in self.replicas.live():
            replica.codec.put(Shutdown(drain=drain))  # first: the codec outlives the talker
            replica.talker.put(Shutdown(drain=drain))
        if self.lifecycle.state is EngineState.DRAINING:
            self.lifecycle.finish()

    async def _wait_idle(self, timeout: float) -> None:
        if not self.lifecycle.healthy:
            return
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            log.warning("shutdown: %d requests still open after %.1f s", len(self.table), timeout)

    async def close(self) -> None:
        """Stop the reader tasks and outboxes (the launcher closes the channels)."""
        for timer in (self._ring_recheck, self._liveness):
            if timer is not None:
                timer.cancel()
        self._ring_recheck = self._liveness = None
        tasks = [*self._client_tasks.values(), *self._worker_tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._client_tasks.clear()
        self._worker_tasks.clear()
        for replica in self.replicas:
            replica.close()
            for fut in replica.ready.values():  # a failed launch awaited only the first one
                if fut.done() and not fut.cancelled():
                    fut.exception()
        for box in self.clients:
            box.close()

    # ---- gauges --------------------------------------------------------------------------------

    def _update_gauges(self) -> None:
        c = self.counters
        c["running"] = self.table.num_running
        c["queued"] = self.table.num_queued
        c["encode_jobs"] = len(self._jobs)
        if not self.table.num_queued:
            c["admission_held"] = 0  # nothing waits, so nothing is held
        for replica in self.replicas:
            c.set_replica(replica.index, "running", len(replica.running))
        if len(self.table) == 0 and not self._jobs:
            self._idle.set()
        else:
            self._idle.clear()

    def _update_ready(self) -> None:
        """`ready`: the engine is healthy and at least one replica is up with both workers
        warmed up (at launch: once every worker said Ready)."""
        warm = any(r.up and r.ready and all(f.done() for f in r.ready.values())
                   for r in self.replicas)
        self.counters["ready"] = 1 if self.lifecycle.healthy and warm else 0

    def _record_memory(self, replica: int, stage: str, memory: MemoryReport) -> None:
        """A worker's memory share and use (its Ready), into the replica's counters and the log."""
        set_ = self.counters.set_replica
        set_(replica, "memory_card_bytes", memory.card)
        set_(replica, "memory_usable_bytes", memory.usable)
        set_(replica, f"{stage}_memory_planned_bytes", memory.planned)
        set_(replica, f"{stage}_memory_peak_bytes", memory.allocator_peak)
        if stage == "talker":
            set_(replica, "talker_kv_tokens", memory.kv_tokens)
        log.info("replica %d %s: %.1f GiB of its card planned, its allocator held at most %.1f of "
                 "its %.1f GiB cap by warm-up's end", replica, stage, memory.planned / GIB,
                 memory.allocator_peak / GIB, memory.allocator_cap / GIB)

    def _update_capacity(self) -> None:
        """`talker_capacity` / `codec_capacity`: summed over the live replicas that said Ready."""
        for stage in ("talker", "codec"):
            self.counters[f"{stage}_capacity"] = sum(r.capacities[stage]
                                                     for r in self.replicas.live())

    def _update_ring_gauge(self) -> None:
        """`ring_bytes` after handling records. Bytes still in a ring the coordinator writes are
        the reader's backlog, which ends without a record telling the coordinator: while the
        gauge reads non-zero it is re-read every 50 ms (else it stays stale, seen as a
        leak that was none)."""
        if self._ring_recheck is not None:
            self._ring_recheck.cancel()
            self._ring_recheck = None
        used = self.ring_bytes()
        self.counters["ring_bytes"] = used
        if used:
            self._ring_recheck = asyncio.get_running_loop().call_later(0.05, self._update_ring_gauge)

    def ring_bytes(self) -> int:
        """Bytes in use in the rings this process holds (a racy snapshot). A replica that is down
        is left out: its workers are gone, so what its rings still hold will never be read and is
        no backlog (the rings go with the replica's restart or the engine's stop)."""
        rings = ([c for r in self.replicas if r.up for c in r.channels.all()]
                 + self._to_clients + self._from_clients)
        return sum(ch.statistics().used_bytes for ch in rings if not ch.closed)

