"""Conformance suite: every channel kind (raw Ring, Channel with msgspec messages, Channel with
numpy payloads) must behave the same, whichever end owns the segment."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvloop

from ipc import ChannelTimeout, EndOfStream, PeerGone, RingClosed, WouldBlock, wait_any
from ipc.ring import record_footprint
from ipc_kinds import KINDS

pytestmark = pytest.mark.timeout(60)  # a lost wake-up must fail fast, not hang

CAPACITY = 4096


@pytest.fixture(params=sorted(KINDS))
def kind(request):
    return KINDS[request.param]


@pytest.fixture(params=["writer", "reader"])
def pair(request, kind, instance):
    """(writer end, reader end) of one ring; the param names which end owns the segment."""
    owner = kind.create("conf", CAPACITY, request.param, instance)
    other = owner.spec().open()
    writer, reader = (owner, other) if request.param == "writer" else (other, owner)
    yield writer, reader
    writer.close()
    reader.close()


def payload(seq: int, n: int) -> bytes:
    return bytes((seq * 7 + i) % 251 for i in range(n))


def test_order_and_wrap(kind, pair):
    writer, reader = pair
    sizes = [0, 1, 63, 64, 65, 500, 1000, 1500, 7, 1200] * 20  # ~100 KB through 4 KiB: ~25 wraps
    pending = []
    for seq, n in enumerate(sizes):
        try:
            kind.send(writer, seq, payload(seq, n), block=False)
            pending.append(seq)
        except WouldBlock:
            for expect in pending:
                assert kind.recv(reader, timeout=1) == (expect, payload(expect, sizes[expect]))
            pending = []
            kind.send(writer, seq, payload(seq, n), block=False)
            pending.append(seq)
    for expect in pending:
        assert kind.recv(reader, timeout=1) == (expect, payload(expect, sizes[expect]))
    assert kind.try_recv(reader) is None
    assert sum(record_footprint(8 + n) for n in sizes) > 20 * CAPACITY
    assert writer.statistics().records == 0 and writer.statistics().used_bytes == 0


def test_zero_length_and_max_size(kind, pair):
    writer, reader = pair
    biggest = kind.max_data(writer)
    assert biggest >= CAPACITY // 2 - 256
    for seq, n in enumerate([0, biggest, 0, biggest, biggest]):  # max records across the wrap
        kind.send(writer, seq, payload(seq, n), timeout=1)
        assert kind.recv(reader, timeout=1) == (seq, payload(seq, n))


def test_too_large_rejected_and_ring_still_usable(kind, pair):
    writer, reader = pair
    with pytest.raises(ValueError, match="max_record_size"):
        kind.send(writer, 1, b"x" * (kind.max_data(writer) + 1), timeout=1)
    kind.send(writer, 2, b"ok", timeout=1)
    assert kind.recv(reader, timeout=1) == (2, b"ok")


def test_full_ring_backpressure(kind, pair):
    writer, reader = pair
    sent = 0
    with pytest.raises(WouldBlock):
        while True:
            kind.send(writer, sent, payload(sent, 300), block=False)
            sent += 1
    assert sent >= 5
    assert writer.statistics().records == sent
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout):
        kind.send(writer, sent, payload(sent, 300), timeout=0.05)
    assert time.monotonic() - t0 >= 0.05
    # a blocked writer resumes as soon as the reader frees room (woken by the space bell)
    woke = []
    t = threading.Thread(target=lambda: (kind.send(writer, sent, payload(sent, 300), timeout=5),
                                         woke.append(time.monotonic())))
    t.start()
    time.sleep(0.05)
    assert not woke
    freed = time.monotonic()
    assert kind.recv(reader, timeout=1) == (0, payload(0, 300))
    t.join(5)
    assert woke and woke[0] - freed < 1.0
    for seq in range(1, sent + 1):  # nothing dropped, nothing overwritten
        assert kind.recv(reader, timeout=1) == (seq, payload(seq, 300))
    assert kind.try_recv(reader) is None


def test_blocking_recv_wakes_on_send_and_times_out(kind, pair):
    writer, reader = pair
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout):
        kind.recv(reader, timeout=0.05)
    assert time.monotonic() - t0 >= 0.05
    timer = threading.Timer(0.05, lambda: kind.send(writer, 9, b"late", timeout=1))
    timer.start()
    assert kind.recv(reader, timeout=5) == (9, b"late")
    timer.join()


def test_writer_close_gives_end_of_stream_after_drain(kind, pair):
    writer, reader = pair
    for seq in range(3):
        kind.send(writer, seq, payload(seq, 10), timeout=1)
    writer.close()
    with pytest.raises(RingClosed):
        kind.send(writer, 3, b"", timeout=1)
    for seq in range(3):
        assert kind.recv(reader, timeout=1) == (seq, payload(seq, 10))
    for _ in range(2):  # sticky
        with pytest.raises(EndOfStream):
            kind.recv(reader, timeout=1)
    with pytest.raises(EndOfStream):
        kind.try_recv(reader)


def test_writer_close_wakes_a_sleeping_reader(kind, pair):
    writer, reader = pair
    timer = threading.Timer(0.05, writer.close)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(EndOfStream):
        kind.recv(reader, timeout=5)
    assert time.monotonic() - t0 < 2
    timer.join()


def test_reader_close(kind, pair):
    writer, reader = pair
    kind.send(writer, 0, b"unread", timeout=1)
    reader.close()
    with pytest.raises(RingClosed):
        kind.recv(reader, timeout=1)
    with pytest.raises(PeerGone, match="closed"):
        kind.send(writer, 1, b"", timeout=1)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_recv_async(kind, pair, loop_kind):
    writer, reader = pair

    async def main():
        loop = asyncio.get_running_loop()
        assert loop_kind == "asyncio" or isinstance(loop, uvloop.Loop)
        waiter = asyncio.ensure_future(kind.recv_async(reader))
        await asyncio.sleep(0.02)
        assert not waiter.done()  # asleep on the doorbell, not spinning through data
        loop.call_soon(lambda: kind.send(writer, 1, b"one", timeout=1))
        assert await asyncio.wait_for(waiter, 5) == (1, b"one")
        kind.send(writer, 2, b"two", timeout=1)  # already there: returns without sleeping
        assert await asyncio.wait_for(kind.recv_async(reader), 5) == (2, b"two")
        loop.call_later(0.02, writer.close)
        with pytest.raises(EndOfStream):
            await asyncio.wait_for(kind.recv_async(reader), 5)

    if loop_kind == "uvloop":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())
    else:
        asyncio.run(main())


def test_wait_any_over_two_channels(kind, instance):
    a = kind.create("wa", CAPACITY, "reader", instance)
    b = kind.create("wb", CAPACITY, "reader", instance)
    wa, wb = a.spec().open(), b.spec().open()
    try:
        for end in (a, b):  # drain the attach hello
            wait_any([end], 0)
        assert wait_any([a, b], 0.02) == []
        timer = threading.Timer(0.05, lambda: kind.send(wb, 5, b"b", timeout=1))
        timer.start()
        assert wait_any([a, b], 5) == [b]
        timer.join()
        assert kind.try_recv(a) is None
        assert kind.try_recv(b) == (5, b"b")
        assert wait_any([a, b], 0) == []  # bells were drained
    finally:
        for end in (a, b, wa, wb):
            end.close()
