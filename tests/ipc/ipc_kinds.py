"""The channel kinds the ipc conformance suite runs against, behind one small adapter.

Every kind moves records ``(seq, data: bytes)``:
- ``ring``: a raw Ring record, ``u64 seq`` then the data bytes;
- ``channel-msgspec``: a Channel message ``Blob(seq, data)``, no payload;
- ``channel-numpy``: a Channel message ``Meta(seq, nbytes)`` with the data as a uint8 payload.
The messages are test-only Structs (the real wire records live in ipc/messages.py).
"""

from __future__ import annotations

import struct

import msgspec
import numpy as np

from ipc import Channel, Ring
from ipc.errors import IpcError

_SEQ = struct.Struct("<Q")


class Blob(msgspec.Struct, tag=True, frozen=True):
    seq: int
    data: bytes


class Meta(msgspec.Struct, tag=True, frozen=True):
    seq: int
    nbytes: int


class Stop(msgspec.Struct, tag=True, frozen=True):
    pass


TestMsg = Blob | Meta | Stop


class Kind:
    """Adapter: create an end, send ``(seq, data)``, receive it back as a copy."""

    name = ""

    def create(self, name: str, capacity: int, role: str, instance: str):
        raise NotImplementedError

    def send(self, end, seq: int, data: bytes, timeout=None, block=True) -> None:
        raise NotImplementedError

    def _take(self, end, got) -> tuple[int, bytes]:
        raise NotImplementedError

    def recv(self, end, timeout=None) -> tuple[int, bytes]:
        return self._take(end, end.recv(timeout))

    def try_recv(self, end) -> tuple[int, bytes] | None:
        got = end.peek() if isinstance(end, Ring) else end.try_recv()
        return None if got is None else self._take(end, got)

    async def recv_async(self, end) -> tuple[int, bytes]:
        return self._take(end, await end.recv_async())

    def max_data(self, end, seq: int = 1) -> int:
        """The largest ``data`` length that fits one record of this kind (for this ``seq``)."""
        raise NotImplementedError


class RingKind(Kind):
    name = "ring"

    def create(self, name, capacity, role, instance):
        return Ring.create(name, capacity, role=role, instance=instance)

    def send(self, end, seq, data, timeout=None, block=True):
        view = end.reserve(8 + len(data), timeout, block=block)
        _SEQ.pack_into(view, 0, seq)
        view[8:] = data
        end.commit()

    def _take(self, end, view):
        out = (_SEQ.unpack_from(view, 0)[0], bytes(view[8:]))
        end.release()
        return out

    def max_data(self, end, seq=1):
        return end.max_record_size - 8


class MsgspecKind(Kind):
    name = "channel-msgspec"

    def create(self, name, capacity, role, instance):
        return Channel.create(name, msg_type=TestMsg, capacity=capacity, role=role,
                              instance=instance)

    def send(self, end, seq, data, timeout=None, block=True):
        end.send(Blob(seq, data), timeout=timeout, block=block)

    def _take(self, end, got):
        assert got.payload is None
        return got.msg.seq, got.msg.data

    def max_data(self, end, seq=1):
        limit = end.ring.max_record_size - 8  # minus the channel frame
        n = limit
        while len(msgspec.msgpack.encode(Blob(seq, b"\0" * n))) > limit:
            n -= 1
        return n


class NumpyKind(Kind):
    name = "channel-numpy"

    def create(self, name, capacity, role, instance):
        return Channel.create(name, msg_type=TestMsg, capacity=capacity, role=role,
                              instance=instance)

    def send(self, end, seq, data, timeout=None, block=True):
        end.send(Meta(seq, len(data)), np.frombuffer(data, np.uint8), timeout=timeout,
                 block=block)

    def _take(self, end, got):
        with got:
            arr = got.array(np.uint8)
            if arr.size and arr.ctypes.data % 64:
                raise IpcError("payload view is not 64-byte aligned")
            assert arr.size == got.msg.nbytes
            return got.msg.seq, arr.tobytes()

    def max_data(self, end, seq=1):
        header = len(msgspec.msgpack.encode(Meta(seq, end.ring.max_record_size)))
        return end.ring.max_record_size - ((8 + header + 63) & -64)


KINDS = {k.name: k for k in (RingKind(), MsgspecKind(), NumpyKind())}
