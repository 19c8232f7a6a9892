"""Cross-process behaviour: spawned peers, a 200k-record stress run, SIGKILLed peers, cleanup."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import numpy as np
import pytest
import uvloop

from ipc import Doorbell, EndOfStream, PeerGone, Ring
from ipc.shm import list_segments
from ipc_children import (SPAWN, echo, open_then_hang, owner_then_hang, ring_bell,
                          stress_reader_owner, tiny_ring_writer, write_then_hang)
from ipc_kinds import KINDS

pytestmark = pytest.mark.timeout(60)  # a lost wake-up must fail fast, not hang

DETECT_BOUND_S = 1.0  # a dead peer must surface within this (pidfd: in practice < 10 ms)


def _kill_later(proc, delay: float, when: list) -> threading.Timer:
    def kill():
        when.append(time.monotonic())
        os.kill(proc.pid, signal.SIGKILL)

    timer = threading.Timer(delay, kill)
    timer.start()
    return timer


@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_stress_200k_records_between_two_spawned_processes(kind_name, instance):
    recv_conn, send_conn = SPAWN.Pipe(duplex=False)
    owner = SPAWN.Process(target=stress_reader_owner,
                          args=(kind_name, 200_000, 1234, 64 * 1024, instance, send_conn))
    owner.start()
    send_conn.close()
    assert recv_conn.poll(60), "stress run did not finish in 60 s"
    result = recv_conn.recv()
    owner.join(10)
    assert result["error"] is None, result
    assert result["count"] == 200_000
    assert result["writer_exit"] == 0 and owner.exitcode == 0
    assert result["wraps"] >= 100, result
    print(f"\n{kind_name}: 200k records, {result['wraps']} wraps, {result['seconds']:.2f} s")


@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_sigkilled_writer_is_peer_gone_for_sleeping_reader(kind_name, instance):
    kind = KINDS[kind_name]
    reader = kind.create("kw", 4096, "reader", instance)
    child = SPAWN.Process(target=write_then_hang, args=(reader.spec(), kind_name, 3))
    child.start()
    try:
        for seq in range(3):  # records committed before the death are still delivered
            assert kind.recv(reader, timeout=10) == (seq, b"x" * seq)
        killed: list[float] = []
        timer = _kill_later(child, 0.1, killed)
        with pytest.raises(PeerGone, match="died"):
            kind.recv(reader, timeout=10)
        assert time.monotonic() - killed[0] < DETECT_BOUND_S
        timer.join()
        with pytest.raises(PeerGone):  # sticky
            kind.try_recv(reader)
    finally:
        child.kill()
        child.join(5)
        reader.close()


@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_sigkilled_reader_is_peer_gone_for_blocked_writer(kind_name, instance):
    kind = KINDS[kind_name]
    writer = kind.create("kr", 4096, "writer", instance)
    ready_recv, ready_send = SPAWN.Pipe(duplex=False)
    child = SPAWN.Process(target=open_then_hang, args=(writer.spec(), ready_send))
    child.start()
    try:
        assert ready_recv.poll(20)
        seq = 0
        while writer.statistics().used_bytes < 3000:
            kind.send(writer, seq, b"z" * 200, block=False)
            seq += 1
        killed: list[float] = []
        timer = _kill_later(child, 0.1, killed)
        with pytest.raises(PeerGone, match="died"):
            kind.send(writer, seq, b"z" * 1500, timeout=10)
        assert time.monotonic() - killed[0] < DETECT_BOUND_S
        timer.join()
    finally:
        child.kill()
        child.join(5)
        writer.close()


@pytest.mark.parametrize("owner_role", ["writer", "reader"])
@pytest.mark.parametrize("kind_name", ["ring", "channel-numpy"])
def test_sigkilled_owner_is_peer_gone_for_opener(kind_name, owner_role, instance):
    reports_recv, reports_send = SPAWN.Pipe(duplex=False)
    owner = SPAWN.Process(target=owner_then_hang,
                          args=(kind_name, owner_role, 3, instance, reports_send))
    owner.start()
    reports_send.close()
    try:
        assert reports_recv.poll(30), "opener never reported"
        assert reports_recv.recv()[0] == "blocking"
        time.sleep(0.1)  # let it fall asleep in poll()
        killed = time.monotonic()
        os.kill(owner.pid, signal.SIGKILL)
        assert reports_recv.poll(10), "opener hung after its owner died"
        outcome, when = reports_recv.recv()
        assert outcome == "PeerGone"
        assert when - killed < DETECT_BOUND_S
    finally:
        owner.kill()
        owner.join(5)
    # the opener unlinked the name when it attached, so the dead owner leaks nothing
    assert list_segments(instance) == []


def test_ping_pong_never_loses_a_wakeup(instance):
    """Every message wakes a sleeping peer; a single lost wake-up would stall into a timeout."""
    to_child = Ring.create("ping", 4096, role="writer", instance=instance)
    from_child = Ring.create("pong", 4096, role="reader", instance=instance)
    n = 3000
    child = SPAWN.Process(target=echo, args=(to_child.spec(), from_child.spec(), n))
    child.start()
    try:
        for i in range(n):
            to_child.send(i.to_bytes(4, "little") * (i % 50), timeout=10)
            assert bytes(from_child.recv(10)) == i.to_bytes(4, "little") * (i % 50)
            from_child.release()
        child.join(10)
        assert child.exitcode == 0
    finally:
        child.kill()
        to_child.close()
        from_child.close()


@pytest.mark.parametrize("reader_loop", ["blocking", "uvloop"])
def test_tiny_ring_backpressure_both_ways(instance, reader_loop):
    """A 256-byte ring: the writer waits for room and the reader for data on nearly every
    record; order and contents survive, and nothing stalls."""
    reader = Ring.create("tiny", 256, role="reader", instance=instance)
    n, seed = 20_000, 99
    sizes = np.random.default_rng(seed).integers(0, reader.max_record_size + 1, n)
    child = SPAWN.Process(target=tiny_ring_writer, args=(reader.spec(), n, seed))
    child.start()

    def check(seq: int, view) -> None:
        assert bytes(view) == seq.to_bytes(8, "little") * (int(sizes[seq]) // 8)
        reader.release()

    async def read_async() -> None:
        for seq in range(n):
            check(seq, await asyncio.wait_for(reader.recv_async(), 10))
        with pytest.raises(EndOfStream):
            await asyncio.wait_for(reader.recv_async(), 10)

    try:
        if reader_loop == "uvloop":
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(read_async())
        else:
            for seq in range(n):
                check(seq, reader.recv(10))
            with pytest.raises(EndOfStream):
                reader.recv(10)
        child.join(10)
        assert child.exitcode == 0
    finally:
        child.kill()
        reader.close()


def test_watch_peer_covers_a_child_that_dies_before_attaching(instance):
    reader = Ring.create("early", 4096, role="reader", instance=instance)
    child = SPAWN.Process(target=time.sleep, args=(30,))  # never opens the spec
    child.start()
    reader.watch_peer(child.pid)
    killed: list[float] = []
    timer = _kill_later(child, 0.1, killed)
    try:
        with pytest.raises(PeerGone):
            reader.recv(10)
        assert time.monotonic() - killed[0] < DETECT_BOUND_S
    finally:
        timer.join()
        child.join(5)
        reader.close()


def test_the_real_opener_replaces_a_watch_peer_guess(instance):
    """The owner guessed the wrong peer (itself, which never dies); the process that actually
    opened the ring is watched once it attaches, so its death still surfaces."""
    reader = Ring.create("guess", 4096, role="reader", instance=instance)
    reader.watch_peer(os.getpid())
    child = SPAWN.Process(target=write_then_hang, args=(reader.spec(), "ring", 1))
    child.start()
    try:
        assert KINDS["ring"].recv(reader, timeout=10) == (0, b"")
        killed: list[float] = []
        timer = _kill_later(child, 0.1, killed)
        with pytest.raises(PeerGone, match=str(child.pid)):
            reader.recv(10)
        assert time.monotonic() - killed[0] < DETECT_BOUND_S
        timer.join()
    finally:
        child.kill()
        child.join(5)
        reader.close()


@pytest.mark.parametrize("bell_kind", ["eventfd", "pipe"])
def test_doorbell_crosses_spawn(bell_kind):
    if bell_kind == "pipe":
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        bell = Doorbell(r, w)
    else:
        bell = Doorbell.create()
    try:
        child = SPAWN.Process(target=ring_bell, args=(bell, 3))
        child.start()
        assert bell.wait(10)
        child.join(10)
        assert child.exitcode == 0
    finally:
        bell.close()
