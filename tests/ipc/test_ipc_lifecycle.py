"""Segment lifecycle and naming, doorbell/peer fallbacks, and misuse errors."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ipc import (Channel, Doorbell, IpcError, Peer, Ring, RingClosed, new_instance_id, sweep_orphans,
                 wait_any)
from ipc.shm import create_segment, list_segments, segment_name, unlink_segment

pytestmark = pytest.mark.timeout(60)  # a lost wake-up must fail fast, not hang

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def test_normal_exit_without_close_leaves_nothing(instance):
    run = subprocess.run([sys.executable, str(HERE / "ipc_exit_script.py"), instance], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
    for noise in ("resource_tracker", "leaked", "Traceback"):
        assert noise not in run.stderr, run.stderr
    assert list_segments(instance) == []


def test_unclosed_ring_warns_and_unlinks(instance):
    ring = Ring.create("gc", 4096, role="writer", instance=instance)
    assert list_segments(instance) == [ring.name]
    with pytest.warns(ResourceWarning, match="unclosed ipc Ring"):
        del ring
        gc.collect()
    assert list_segments(instance) == []


def test_collected_writer_counts_as_closed(instance):
    reader = Ring.create("gcw", 4096, role="reader", instance=instance)
    writer = reader.spec().open()
    writer.send(b"last")
    with pytest.warns(ResourceWarning):
        del writer
        gc.collect()
    assert bytes(reader.recv(1)) == b"last"
    reader.release()
    with pytest.raises(Exception, match="writer closed"):
        reader.recv(1)
    reader.close()


def test_names_carry_instance_and_pid_and_never_collide():
    a, b = new_instance_id(), new_instance_id()
    assert a != b
    ra = Ring.create("same", 4096, role="writer", instance=a)
    rb = Ring.create("same", 4096, role="writer", instance=b)
    try:
        assert ra.name == segment_name(a, "same") == f"mvx-{a}-{os.getpid()}-same"
        assert ra.name != rb.name
        with pytest.raises(FileExistsError):
            Ring.create("same", 4096, role="reader", instance=a)
    finally:
        ra.close()
        rb.close()
    assert list_segments(a) == list_segments(b) == []


def test_spec_opens_once_and_opener_unlinks(instance):
    owner = Ring.create("once", 4096, role="writer", instance=instance)
    spec = owner.spec()
    other = spec.open()
    assert list_segments(instance) == []  # both ends mapped: the name is gone already
    with pytest.raises(FileNotFoundError):
        spec.open()
    with pytest.raises(IpcError, match="owner"):
        other.spec()
    other.close()
    owner.close()


def test_sweep_orphans_removes_only_dead_owners(instance):
    script = ("import os, signal, sys; from ipc.shm import create_segment, segment_name; "
              "create_segment(segment_name(sys.argv[1], 'orphan'), 4096); "
              "os.kill(os.getpid(), signal.SIGKILL)")
    run = subprocess.run([sys.executable, "-c", script, instance], cwd=ROOT, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == -signal.SIGKILL
    assert len(list_segments(instance)) == 1  # killed before any opener attached: left behind
    alive = create_segment(segment_name(instance, "alive"), 4096)
    try:
        removed = sweep_orphans(instance)
        assert len(removed) == 1 and removed[0].endswith("-orphan")
        assert list_segments(instance) == [alive.name]
    finally:
        alive.close()
        unlink_segment(alive.name)


def test_pipe_doorbell_fallback():
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    bell = Doorbell(r, w)
    try:
        assert not bell.wait(0.01)
        for _ in range(100_000):  # more rings than the pipe holds: never blocks
            bell.ring()
        assert bell.wait(0)
        assert not bell.drain() and not bell.wait(0.01)  # one drain took every ring
    finally:
        bell.close()


def test_peer_watches_a_process_exit():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    peer = Peer(proc.pid)
    try:
        assert peer.alive()
        assert wait_any([peer], 0.01) == []
        t0 = time.monotonic()
        proc.kill()
        assert wait_any([peer], 5) == [peer]
        assert time.monotonic() - t0 < 1.0
        assert not peer.alive()
    finally:
        proc.kill()
        proc.wait()
        peer.close()
    fallback = Peer(proc.pid)  # pid reaped: counts as dead without a pidfd
    assert not fallback.alive()


def test_received_must_be_released_before_the_next(instance):
    writer = Channel.create("held", msg_type=int, capacity=4096, role="writer", instance=instance)
    reader = writer.spec().open()
    try:
        writer.send(1, np.arange(4, dtype=np.float32))
        writer.send(2, np.arange(8, dtype=np.float32).reshape(2, 4))
        writer.send(3)
        first = reader.recv(1)
        assert first.msg == 1 and first.array(np.float32).tolist() == [0, 1, 2, 3]
        assert reader.statistics().records == 3
        with pytest.raises(IpcError, match="release"):
            reader.try_recv()
        first.release()
        first.release()  # idempotent
        with reader.recv(1) as second:
            assert second.array(np.float32, (2, 4))[1, 3] == 7
        third = reader.recv(1)
        assert third.msg == 3 and third.payload is None  # payload-less: released at once
        assert reader.statistics() == (0, 4096, 0)
    finally:
        writer.close()
        reader.close()


def test_strided_and_bytes_payloads(instance):
    writer = Channel.create("strided", msg_type=str, capacity=1 << 16, role="writer",
                            instance=instance)
    reader = writer.spec().open()
    try:
        grid = np.arange(60, dtype=np.int64).reshape(6, 10)
        writer.send("cols", grid[:, ::3])  # non-contiguous: sent as a C-contiguous copy
        writer.send("bytes", b"\x01\x02")
        writer.send("empty", np.zeros(0, np.int16))
        with reader.recv(1) as got:
            assert got.msg == "cols"
            np.testing.assert_array_equal(got.array(np.int64, (6, 4)), grid[:, ::3])
        with reader.recv(1) as got:
            assert bytes(got.payload) == b"\x01\x02"
        with reader.recv(1) as got:
            assert got.payload is not None and got.payload.nbytes == 0
    finally:
        writer.close()
        reader.close()


def test_close_while_a_payload_view_is_held(instance):
    writer = Channel.create("view", msg_type=int, capacity=4096, role="writer", instance=instance)
    reader = writer.spec().open()
    writer.send(7, np.arange(16, dtype=np.int32))
    got = reader.recv(1)
    held = got.array(np.int32)  # a numpy view into the mapping outlives the channel
    reader.close()
    writer.close()
    assert list_segments(instance) == []
    assert held[15] == 15  # the mapping stays valid while a view holds it
    with pytest.raises(RingClosed):
        reader.statistics()
    got.release()  # harmless after close
    del held, got
    gc.collect()


async def test_doorbell_wait_async():
    bell = Doorbell.create()
    try:
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, bell.ring)
        await asyncio.wait_for(bell.wait_async(), 5)
        assert not bell.drain()  # wait_async drained it
    finally:
        bell.close()


def test_torch_cpu_tensor_payload(instance):
    torch = pytest.importorskip("torch")
    writer = Channel.create("torch", msg_type=str, capacity=4096, role="writer", instance=instance)
    reader = writer.spec().open()
    try:
        codes = torch.arange(24, dtype=torch.int64).reshape(2, 12)
        writer.send("codes", codes.t())  # a transposed (strided) tensor arrives in C order
        with reader.recv(1) as got:
            received = torch.from_numpy(got.array(np.int64, (12, 2)))
            assert torch.equal(received, codes.t())
    finally:
        writer.close()
        reader.close()


def test_reserve_commit_shrink_and_batched_notify(instance):
    writer = Ring.create("shrink", 2048, role="writer", instance=instance)
    reader = writer.spec().open()
    try:
        writer.send(b"\0" * 900)  # move the positions on (to 1024), so the batch below wraps
        reader.recv(1)
        reader.release()
        wait_any([reader], 0)  # drain the bell
        for i in range(6):  # 6 x (64 + 128) bytes from offset 1024: wraps once
            view = writer.reserve(200, timeout=1)
            view[:100] = bytes([i]) * 100
            writer.commit(100, notify=False)  # shrink to what was written; no wake-up yet
        assert writer.statistics().records == 6
        assert wait_any([reader], 0.02) == []  # nobody was woken
        writer.notify()
        assert wait_any([reader], 1) == [reader]
        for i in range(6):
            assert bytes(reader.recv(1)) == bytes([i]) * 100
            reader.release()
        writer.reserve(10, timeout=1)
        with pytest.raises(ValueError):
            writer.commit(11)
    finally:
        writer.close()
        reader.close()
