"""The ring segment's layout: header words, record framing, and what an open end holds.

See ``ipc.ring`` for the layout drawing and the memory-ordering argument; this module only names
the numbers and releases an end's resources (also from a finalizer, so it must not reference the
``Ring``).
"""

from __future__ import annotations

import warnings
from typing import Literal, NamedTuple

from ipc.doorbell import Doorbell
from ipc.peer import Peer
from ipc.shm import unlink_segment

HEADER_BYTES = 512
RECORD_HEADER = 64
ALIGN = 64
MIN_CAPACITY = 256
WRAP = 2**64 - 1
MAGIC = int.from_bytes(b"MVXRING1", "little")

# Header word indices (8-byte words), one 128-byte block per writer and rate of change.
W_MAGIC, W_CAPACITY, W_OWNER_PID, W_OWNER_ROLE, W_OPENER_PID = 0, 1, 2, 3, 4  # set once
W_WRITE_POS, W_WRITE_COUNT = 16, 17  # writer, per record
W_BEAT = 18  # writer: its liveness beat (`Ring.beat`), bumped by its loop whether or not it writes
W_READ_POS, W_READ_COUNT = 32, 33  # reader, per record
W_WRITER_CLOSED, W_READER_CLOSED = 48, 49  # each written once: read every record, cache-hot

Role = Literal["writer", "reader"]
ROLE_CODE = {"writer": 1, "reader": 2}


class RingStatistics(NamedTuple):
    """A snapshot of a ring's fill (racy by nature: the peer keeps moving)."""

    used_bytes: int
    capacity: int
    records: int


def record_footprint(n: int) -> int:
    """Bytes a record of ``n`` payload bytes occupies in the ring (header + aligned payload)."""
    return RECORD_HEADER + ((n + ALIGN - 1) & -ALIGN)


class EndResources:
    """What must be released when a ring closes or is collected; holds no reference to the Ring."""

    def __init__(self, shm, role: Role, owner: bool, bells: tuple[Doorbell, Doorbell]) -> None:
        self.shm = shm
        self.role = role
        self.owner = owner
        self.bells = bells
        self.peer: Peer | None = None
        self.views: list[memoryview] = []

    def release(self, warn: bool) -> None:
        name = self.shm.name
        if warn:
            warnings.warn(f"unclosed ipc Ring {name!r} ({self.role})", ResourceWarning, stacklevel=2)
        words = self.views[0] if self.views else None
        if words is not None:  # tell the peer: a collected end is a closed end
            if self.role == "writer":
                words[W_WRITER_CLOSED] = 1
                self.bells[0].ring()
            else:
                words[W_READER_CLOSED] = 1
                self.bells[1].ring()
        for v in self.views:
            v.release()
        self.views = []
        try:
            self.shm.close()
        except BufferError:
            # A caller still holds a view of a record; the mapping goes when that view does.
            self.shm._mmap = None  # noqa: SLF001 (lets SharedMemory close its fd, not the map)
            self.shm.close()
        if self.owner:
            unlink_segment(name)
        for bell in self.bells:
            bell.close()
        if self.peer is not None:
            self.peer.close()
