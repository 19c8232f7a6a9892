"""Typed channel: a ring + its doorbells + a msgspec msgpack codec for one union of wire records.

One message is one ring record (so a control record and its data never separate)::

    u32 msg length | u32 flags (bit 0: has payload) | msgpack msg | pad to 64 | payload bytes

The payload (codes, PCM) starts 64-byte aligned, so the reader's ``Received.array(dtype, shape)``
is an aligned zero-copy numpy view of shared memory, valid until ``release()``. A message without
a payload is decoded and released at once. The reader holds at most one record at a time.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from ipc.errors import IpcError
from ipc.ring import Ring, RingSpec, RingStatistics, Role
from ipc.ring_layout import RECORD_HEADER

T = TypeVar("T")

_FRAME = struct.Struct("<II")
_FRAME_BYTES = 8
_HAS_PAYLOAD = 1
_ALIGN = 64

ChannelStatistics = RingStatistics  # used_bytes, capacity, records


def max_payload_bytes(capacity: int) -> int:
    """Largest payload one record of a channel of ring ``capacity`` carries beside a message of
    up to 56 encoded bytes (``Channel.max_payload_size`` without opening a ring)."""
    return capacity // 2 - RECORD_HEADER - _ALIGN


class Received(Generic[T]):
    """One received message: ``msg``, and ``payload`` (a memoryview into the ring, or None when
    the sender sent none). The payload is valid until ``release()``; also a context manager."""

    __slots__ = ("msg", "payload", "_channel")

    def __init__(self, msg: T, payload: memoryview | None, channel: Channel | None) -> None:
        self.msg = msg
        self.payload = payload
        self._channel = channel

    def array(self, dtype, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The payload as a read-only numpy view (no copy)."""
        if self.payload is None:
            raise IpcError("this message has no payload")
        arr = np.frombuffer(self.payload, dtype=dtype)
        return arr if shape is None else arr.reshape(shape)

    def release(self) -> None:
        """Give the record's space back to the writer (idempotent)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            self.payload = None
            channel._release()  # noqa: SLF001

    def __enter__(self) -> Received[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        size = None if self.payload is None else self.payload.nbytes
        return f"Received({self.msg!r}, payload_bytes={size})"


@dataclass(frozen=True)
class ChannelSpec:
    """Picklable handle on a channel for the other process (``spec.open()`` there)."""

    ring: RingSpec
    msg_type: Any

    def open(self) -> Channel:
        ring = self.ring.open()
        try:
            return Channel(ring, self.msg_type)
        except BaseException:
            ring.close()
            raise


class Channel(Generic[T]):
    """One end of a typed SPSC channel carrying ``msg_type`` messages with optional raw payloads.

    Build with ``Channel.create`` (the owner) or ``ChannelSpec.open`` (the other process).
    """

    def __init__(self, ring: Ring, msg_type: Any) -> None:
        self._ring = ring
        self.msg_type = msg_type
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self._scratch = bytearray(256)
        self._held = False

    @classmethod
    def create(cls, name: str, *, msg_type: Any, capacity: int, role: Role,
               instance: str) -> Channel:
        """Create the channel's ring (segment ``mvx-{instance}-{pid}-{name}``); this end is
        ``role`` and the owner."""
        ring = Ring.create(name, capacity, role=role, instance=instance)
        try:
            return cls(ring, msg_type)
        except BaseException:  # e.g. msg_type is not a decodable union: do not leak the segment
            ring.close()
            raise

    def spec(self) -> ChannelSpec:
        """Picklable handle for the other process (pass it as a Process argument)."""
        return ChannelSpec(self._ring.spec(), self.msg_type)

    @property
    def ring(self) -> Ring:
        return self._ring

    @property
    def max_payload_size(self) -> int:
        """Largest payload that fits one record beside a message of up to 56 encoded bytes
        (the frame header and message share the first 64-byte line)."""
        return self._ring.max_record_size - _ALIGN  # = max_payload_bytes(capacity)

    # -- writer ---------------------------------------------------------------------------------
    def send(self, msg: T, payload: Any = None, timeout: float | None = None, *,
             block: bool = True) -> None:
        """Send ``msg`` and optional ``payload`` (a numpy array, bytes-like, or CPU torch tensor;
        its bytes are copied in C order) as one record. The receiver learns dtype and shape from
        ``msg``: the record carries raw bytes.

        Waits up to ``timeout`` s for room (``ChannelTimeout``) or raises ``WouldBlock`` when
        ``block`` is False; ``ValueError`` if the record exceeds the ring's max record size."""
        scratch = self._scratch
        self._encoder.encode_into(msg, scratch)
        m = len(scratch)
        ring = self._ring
        if payload is None:
            total = _FRAME_BYTES + m
            at = ring._claim(total, timeout, block)  # noqa: SLF001 (package-internal fast path)
            buf = ring._buf  # noqa: SLF001
            _FRAME.pack_into(buf, at, m, 0)
            buf[at + _FRAME_BYTES:at + total] = scratch
        else:
            data = _byte_view(payload)
            start = (_FRAME_BYTES + m + _ALIGN - 1) & -_ALIGN
            total = start + data.nbytes
            at = ring._claim(total, timeout, block)  # noqa: SLF001
            buf = ring._buf  # noqa: SLF001
            _FRAME.pack_into(buf, at, m, _HAS_PAYLOAD)
            buf[at + _FRAME_BYTES:at + _FRAME_BYTES + m] = scratch
            buf[at + start:at + total] = data
        ring._publish(*ring._reserved, True)  # noqa: SLF001

    def beat(self) -> None:
        """Writer: one liveness beat (``Ring.beat``): no record, nobody woken."""
        self._ring.beat()

    # -- reader ---------------------------------------------------------------------------------
    def recv(self, timeout: float | None = None) -> Received[T]:
        """The next message, sleeping up to ``timeout`` s (None: forever; ``ChannelTimeout``).

        ``EndOfStream`` when the writer closed and all was read; ``PeerGone`` when it died."""
        self._check_not_held()
        return self._decode(self._ring.recv(timeout))

    def try_recv(self) -> Received[T] | None:
        """The next message if one is there now, else None (never sleeps)."""
        self._check_not_held()
        view = self._ring.peek()
        return None if view is None else self._decode(view)

    async def recv_async(self) -> Received[T]:
        """The next message, awaiting the doorbell on the running asyncio loop."""
        self._check_not_held()
        return self._decode(await self._ring.recv_async())

    def _decode(self, view: memoryview) -> Received[T]:
        m, flags = _FRAME.unpack_from(view, 0)
        try:
            msg = self._decoder.decode(view[_FRAME_BYTES:_FRAME_BYTES + m])
        except BaseException:
            self._ring.release()  # a bad record must not wedge the channel
            raise
        if not flags & _HAS_PAYLOAD:
            self._ring.release()
            return Received(msg, None, None)
        self._held = True
        return Received(msg, view[(_FRAME_BYTES + m + _ALIGN - 1) & -_ALIGN:], self)

    def _release(self) -> None:
        if self._held:
            self._held = False
            if not self._ring.closed:
                self._ring.release()

    def _check_not_held(self) -> None:
        if self._held:
            raise IpcError("release() the previous Received before receiving the next one")

    # -- both ends ------------------------------------------------------------------------------
    def statistics(self) -> ChannelStatistics:
        """Used bytes, capacity and records in flight (a racy snapshot)."""
        return self._ring.statistics()

    @property
    def beats(self) -> int:
        """The writer's liveness beats so far (``Ring.beats``)."""
        return self._ring.beats

    def watch_peer(self, pid: int) -> None:
        """Watch ``pid`` as the peer before it attaches (e.g. a just-spawned child)."""
        self._ring.watch_peer(pid)

    def wait_fds(self) -> tuple[int, ...]:
        return self._ring.wait_fds()

    def on_wake(self, fd: int) -> None:
        self._ring.on_wake(fd)

    @property
    def needs_liveness_slices(self) -> bool:
        return self._ring.needs_liveness_slices

    @property
    def closed(self) -> bool:
        return self._ring.closed

    def close(self) -> None:
        """Close this end (idempotent); an unreleased payload view becomes invalid."""
        self._held = False
        self._ring.close()

    def __enter__(self) -> Channel[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Channel({self._ring!r}, msg_type={self.msg_type!r})"


def _byte_view(payload) -> memoryview:
    """A flat unsigned-byte view of an array, a bytes-like object, or anything ``np.asarray``
    takes without copying (e.g. a CPU torch tensor); copies only if the data is strided."""
    if not isinstance(payload, np.ndarray):
        try:
            view = memoryview(payload)
        except TypeError:
            payload = np.asarray(payload)
        else:
            if view.format == "B" and view.ndim == 1:
                return view
            if view.c_contiguous:
                return view.cast("B")
            payload = np.asarray(payload)
    if payload.flags.c_contiguous and payload.ndim:
        try:
            return memoryview(payload).cast("B")  # the fast path: no numpy calls
        except (TypeError, ValueError, NotImplementedError):  # formats memoryview cannot cast
            pass
    return memoryview(np.ascontiguousarray(payload).reshape(-1).view(np.uint8))
