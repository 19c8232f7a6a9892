"""Cross-process behaviour: spawned peers, a 200k-record stress run, SIGKILLed peers, cleanup."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ipc import PeerGone
from ipc.shm import list_segments
from ipc_children import (SPAWN, open_then_hang, owner_then_hang, stress_reader_owner,
                          write_then_hang)
from ipc_kinds import KINDS

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
