"""Outbox: never blocks the loop; when the ring is full, records wait in order and are flushed as
the reader makes room (woken by the ring's space doorbell, no polling); a gone peer is reported."""

from __future__ import annotations

import asyncio

import numpy as np

from engine.outbox import Outbox
from ipc.channel import Channel
from ipc.messages import ClientInbox, Failed, PcmChunk
from ipc.shm import new_instance_id


def pair(capacity: int = 4096):
    w = Channel.create("ob", msg_type=ClientInbox, capacity=capacity, role="writer",
                       instance=new_instance_id())
    return w, w.spec().open()


async def test_backlog_flushes_in_order_when_the_reader_makes_room() -> None:
    w, r = pair()
    box = Outbox(w, "test")
    try:
        payload = np.arange(256, dtype=np.float32)  # 1 KiB each: the ring holds a few
        for seq in range(20):
            assert box.put(PcmChunk(rid=1, seq=seq, final=False), payload)
        assert box.backlog > 0                     # put returned at once, nothing blocked
        got = []
        while len(got) < 20:
            rec = await asyncio.wait_for(r.recv_async(), 5)
            got.append(rec.msg.seq)
            assert (rec.array(np.float32) == payload).all()
            rec.release()
            await asyncio.sleep(0)                 # let the flush task run
        assert got == list(range(20)) and box.backlog == 0
    finally:
        box.close()
        r.close()
        w.close()


async def test_a_closed_reader_breaks_the_outbox() -> None:
    w, r = pair()
    box = Outbox(w, "test")
    try:
        r.close()
        assert box.put(Failed(rid=3, message="x")) is False
        assert box.broken is not None
        assert box.put(Failed(rid=4, message="y")) is False   # dropped, never raises
    finally:
        box.close()
        w.close()
