"""Single-producer single-consumer ring of variable-length records in shared memory.

Layout of the segment (all integers little-endian u64, 8-byte aligned)::

    [0, 512)      header, four 128-byte blocks (two cache lines each, so the adjacent-line
                  prefetcher does not make the two sides' hot words share a line):
                    block 0  magic, capacity, owner pid, owner role, opener pid (set once)
                    block 1  write position, records written   (writer only, every record),
                             liveness beat (writer only, from its loop)
                    block 2  read position, records read       (reader only, every record)
                    block 3  writer-closed, reader-closed flags (each written once)
    [512, 512+C)  data, C = capacity bytes (a multiple of 64)

Each side keeps the last value it read of the other's position and reloads it only when that
value says "full" (writer) or "empty" (reader), so in steady streaming the two hot blocks do not
bounce between cores on every record. A stale copy is always conservative: positions only grow,
so an old read position understates the room and an old write position understates the data.

A record is a 64-byte header (its payload length in the first word) then the payload padded to
64 bytes, so every payload starts 64-byte aligned (numpy / torch views of it are aligned). Records
never split across the end of the data area: when a record does not fit in the tail, the writer
stores ``WRAP`` in the next header and the record goes to offset 0. The positions are
monotonically increasing byte counters (never reset; 2**64 bytes will not be reached), offset =
position mod C, used = write - read. A record of at most ``C/2 - 64`` payload bytes
(``max_record_size``) always fits into an empty ring whatever the wrap point, so the writer can
always make progress once the reader catches up. The ring is bounded: a writer that finds no room
waits on the space doorbell (or raises ``WouldBlock``); nothing is dropped or overwritten.

Memory ordering: why a reader never sees a committed record before its payload.

- Each counter has a single writer: the write position is stored only by the writer process,
  the read position only by the reader. Neither needs a read-modify-write.
- The writer stores the payload (a memcpy through a memoryview), then the record header, then
  the write position, in program order; the reader loads the write position, then the header and
  payload. The reader's release stores the read position after its loads of the payload.
- Each u64 access is one aligned 8-byte load or store: CPython's memoryview item get/set for
  format ``Q`` is a fixed-size ``memcpy`` that compiles to a single ``mov``, and aligned 8-byte
  accesses are single-copy atomic on x86-64 and AArch64, so a counter is never seen torn.
- The compiler cannot move these accesses across each other: each is a separate C call from the
  interpreter loop on memory that escapes (a shared mapping).
- x86-64 is TSO: stores become visible in program order (no store-store reordering) and loads
  are not reordered with older loads or with younger stores. So a reader that sees the new write
  position also sees the header and payload stored before it, and the writer's reuse of space
  (after it sees the new read position) cannot overtake the reader's earlier loads.
- CPython itself promises nothing about cross-process memory order; the argument rests on the
  hardware model above. On weaker models (AArch64, POWER) the writer would need a release store
  (or ``dmb ish`` / ``lwsync``) before publishing the write position and the reader an acquire
  load (or fence) after reading it, likewise around the read position; that needs a small C
  helper (``__atomic_store_n(..., __ATOMIC_RELEASE)``). ``Ring`` warns when it runs on anything
  but x86-64.
- Closing stores the closed flag after the last write position; a reader that finds the ring
  empty and the flag set loads the write position once more before reporting ``EndOfStream``,
  so a record committed just before the close is never lost.
- Sleeping uses doorbells (``ipc.doorbell``): the writer rings the data bell after each commit,
  the reader rings the space bell after each release, and a sleeper drains its bell before its
  last look at the counters; the eventfd's kernel lock orders ring and drain, so no wake-up is
  lost (see that module).

Lifecycle: the owner creates the segment (``Ring.create``) and hands ``ring.spec()`` to the other
process, which calls ``spec.open()``. The opener writes its pid into the header, unlinks the
segment name at once (both mappings stay valid, so no ``/dev/shm`` entry can outlive the two
processes from then on), and rings both bells so an owner already asleep learns the pid. The
owner also unlinks on ``close()``. Each side watches the other's pid (``ipc.peer``) in the same
poll as its doorbell, so a dead peer surfaces as ``PeerGone`` instead of a hang.
"""

from __future__ import annotations

import asyncio
import os
import platform
import select
import time
import warnings
import weakref
from dataclasses import dataclass

from ipc.doorbell import Doorbell
from ipc.errors import ChannelTimeout, EndOfStream, IpcError, PeerGone, RingClosed, WouldBlock
from ipc.peer import FALLBACK_SLICE_S, Peer
from ipc.ring_layout import (ALIGN, HEADER_BYTES, MAGIC, MIN_CAPACITY, RECORD_HEADER, ROLE_CODE,
                             W_CAPACITY, W_MAGIC, W_OPENER_PID, W_OWNER_PID, W_OWNER_ROLE,
                             W_BEAT, W_READ_COUNT, W_READ_POS, W_READER_CLOSED, W_WRITE_COUNT,
                             W_WRITE_POS,
                             W_WRITER_CLOSED, WRAP, EndResources, RingStatistics, Role,
                             record_footprint)
from ipc.shm import attach_segment, create_segment, segment_name, unlink_segment

@dataclass(frozen=True)
class RingSpec:
    """What the other process needs to open a ring: small and picklable (fds travel via DupFd)."""

    segment: str
    capacity: int
    owner_pid: int
    opener_role: Role
    data_bell: Doorbell
    space_bell: Doorbell

    def open(self) -> Ring:
        """Attach to the ring in this process, taking the role the owner left free. Once only."""
        return Ring._open(self)


class Ring:
    """One end (writer or reader) of an SPSC shared-memory record ring. Build with ``create``
    (owner) or ``RingSpec.open`` (the other process)."""

    def __init__(self, shm, *, role: Role, owner: bool, data_bell: Doorbell, space_bell: Doorbell,
                 peer_pid: int | None) -> None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            warnings.warn("ipc.Ring's memory-ordering argument assumes x86-64 (TSO); see the "
                          "module docstring", RuntimeWarning, stacklevel=3)
        self._shm = shm
        self._buf = shm.buf
        self._words = shm.buf.cast("Q")
        self.role: Role = role
        self.owner = owner
        self._data_bell = data_bell
        self._space_bell = space_bell
        self._cap = self._words[W_CAPACITY]
        self.max_record_size = self._cap // 2 - RECORD_HEADER
        self._closed = False
        self._writable = role == "writer"
        self._readable = role == "reader"
        self._poller: select.poll | None = None
        self._poll_fds: tuple[int, ...] = ()
        # writer state
        self._wpos = self._words[W_WRITE_POS]
        self._rseen = self._words[W_READ_POS]  # the writer's last look at the read position
        self._wcount = self._words[W_WRITE_COUNT]
        self._reserved: tuple[int, int, int] | None = None  # (n, skip, footprint)
        # reader state
        self._rpos = self._words[W_READ_POS]
        self._wseen = self._words[W_WRITE_POS]  # the reader's last look at the write position
        self._rcount = self._words[W_READ_COUNT]
        self._head: tuple[memoryview, int] | None = None  # (view, footprint)
        self._res = EndResources(shm, role, owner, (data_bell, space_bell))
        self._res.views = [self._words, self._buf]
        self._peer_settled = bool(peer_pid)  # the opener knows its peer; the owner learns it
        if peer_pid:
            self._res.peer = Peer(peer_pid)
        self._finalizer = weakref.finalize(self, self._res.release, True)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, capacity: int, *, role: Role, instance: str) -> Ring:
        """Create a ring in a new segment ``mvx-{instance}-{pid}-{name}``; this process is its
        owner and takes ``role``. ``capacity`` (data bytes) must be a multiple of 64, >= 256."""
        if capacity < MIN_CAPACITY or capacity % ALIGN:
            raise ValueError(f"ring capacity must be a multiple of {ALIGN} and >= {MIN_CAPACITY}, "
                             f"got {capacity}")
        if role not in ROLE_CODE:
            raise ValueError(f"role must be 'writer' or 'reader', got {role!r}")
        shm = create_segment(segment_name(instance, name), HEADER_BYTES + capacity)
        words = shm.buf.cast("Q")
        words[W_CAPACITY] = capacity
        words[W_OWNER_PID] = os.getpid()
        words[W_OWNER_ROLE] = ROLE_CODE[role]
        words[W_MAGIC] = MAGIC
        words.release()
        return cls(shm, role=role, owner=True, data_bell=Doorbell.create(),
                   space_bell=Doorbell.create(), peer_pid=None)

    @classmethod
    def _open(cls, spec: RingSpec) -> Ring:
        shm = attach_segment(spec.segment)
        words = shm.buf.cast("Q")
        try:
            if words[W_MAGIC] != MAGIC or words[W_CAPACITY] != spec.capacity:
                raise IpcError(f"segment {spec.segment} is not a ring of capacity {spec.capacity}")
            if words[W_OPENER_PID]:
                raise IpcError(f"ring {spec.segment} was already opened by pid "
                               f"{words[W_OPENER_PID]}")
            words[W_OPENER_PID] = os.getpid()
        except BaseException:
            words.release()
            shm.close()
            raise
        words.release()
        unlink_segment(spec.segment)  # both ends are mapped now: the name has done its job
        ring = cls(shm, role=spec.opener_role, owner=False, data_bell=_adopt(spec.data_bell),
                   space_bell=_adopt(spec.space_bell), peer_pid=spec.owner_pid)
        ring._data_bell.ring()  # wake an owner asleep on either bell so it learns our pid
        ring._space_bell.ring()
        return ring

    def spec(self) -> RingSpec:
        """The picklable handle the other process opens (only the owner hands one out)."""
        if not self.owner:
            raise IpcError("only the owner of a ring can hand out its spec")
        return RingSpec(self._shm.name, self._cap, os.getpid(),
                        "reader" if self.role == "writer" else "writer",
                        self._data_bell, self._space_bell)

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def closed(self) -> bool:
        return self._closed

    def watch_peer(self, pid: int) -> None:
        """Watch ``pid`` as the peer until the real opener attaches (e.g. a just-spawned child
        that will open the spec): a child dying before it attaches is then ``PeerGone`` too."""
        if self._res.peer is None and not self._peer_settled:
            self._res.peer = Peer(pid)

    # -- writer ---------------------------------------------------------------------------------
    def reserve(self, n: int, timeout: float | None = None, *, block: bool = True) -> memoryview:
        """A writable view of ``n`` payload bytes; publish it with ``commit()``.

        Waits up to ``timeout`` seconds (None: forever) for room, raising ``ChannelTimeout``, or
        raises ``WouldBlock`` at once if ``block`` is False. ``PeerGone`` if the reader closed
        or died, ``ValueError`` if ``n`` exceeds ``max_record_size``.
        """
        start = self._claim(n, timeout, block)
        return self._buf[start:start + n]

    def commit(self, n: int | None = None, *, notify: bool = True) -> None:
        """Publish the reserved record (its first ``n`` bytes if given, n <= reserved).

        With ``notify=False`` the reader is not woken; call ``notify()`` after a batch."""
        if self._reserved is None:
            raise IpcError("commit() without reserve()")
        reserved, skip, size = self._reserved
        if n is None:
            n = reserved
        elif not 0 <= n <= reserved:
            raise ValueError(f"commit({n}) exceeds the reserved {reserved} bytes")
        else:
            size = RECORD_HEADER + ((n + ALIGN - 1) & -ALIGN)
        self._publish(n, skip, size, notify)

    def send(self, data, timeout: float | None = None, *, block: bool = True) -> None:
        """Copy a bytes-like ``data`` into one record and publish it (reserve + copy + commit).

        The data plane's hot path, so ``_claim`` and ``_publish`` are inlined here (about 20%
        of the per-record cost); keep the three in step."""
        n = len(data)
        if self._reserved is not None or not self._writable:
            self._raise_not_writable()
        if n > self.max_record_size:
            raise ValueError(f"record of {n} bytes exceeds this ring's max_record_size "
                             f"{self.max_record_size} (capacity {self._cap})")
        size = RECORD_HEADER + ((n + ALIGN - 1) & -ALIGN)
        cap = self._cap
        w = self._wpos
        off = w % cap
        skip = cap - off if size > cap - off else 0
        words = self._words
        if self._rseen < w + skip + size - cap or words[W_READER_CLOSED]:
            self._wait_for_space(w + skip + size - cap, timeout, block)
        if skip:
            words[(HEADER_BYTES + off) >> 3] = WRAP
            w += skip
            off = 0
        start = HEADER_BYTES + off
        self._buf[start + RECORD_HEADER:start + RECORD_HEADER + n] = data
        words[start >> 3] = n
        self._wcount += 1
        words[W_WRITE_COUNT] = self._wcount
        w += size
        self._wpos = w
        words[W_WRITE_POS] = w  # publication point: everything above is visible before this
        self._data_bell.ring()

    def _claim(self, n: int, timeout: float | None, block: bool) -> int:
        """Find room for a record of ``n`` bytes (waiting if needed); returns its payload offset
        in the segment and remembers ``(n, wrap skip, footprint)`` for ``_publish``."""
        if self._reserved is not None or not self._writable:
            self._raise_not_writable()
        if n > self.max_record_size or n < 0:
            raise ValueError(f"record of {n} bytes exceeds this ring's max_record_size "
                             f"{self.max_record_size} (capacity {self._cap})")
        size = RECORD_HEADER + ((n + ALIGN - 1) & -ALIGN)
        cap = self._cap
        w = self._wpos
        off = w % cap
        skip = cap - off if size > cap - off else 0
        needed_read = w + skip + size - cap  # the read position that leaves enough room
        words = self._words
        if self._rseen < needed_read or words[W_READER_CLOSED]:
            self._wait_for_space(needed_read, timeout, block)
        self._reserved = (n, skip, size)
        return HEADER_BYTES + RECORD_HEADER + (0 if skip else off)

    def _publish(self, n: int, skip: int, size: int, notify: bool) -> None:
        words = self._words
        w = self._wpos
        if skip:
            words[(HEADER_BYTES + w % self._cap) >> 3] = WRAP
            w += skip
        words[(HEADER_BYTES + w % self._cap) >> 3] = n
        self._wcount += 1
        words[W_WRITE_COUNT] = self._wcount
        w += size
        self._wpos = w
        words[W_WRITE_POS] = w  # publication point: everything above is visible before this
        self._reserved = None
        if notify:
            self._data_bell.ring()

    def _raise_not_writable(self) -> None:
        if self._closed:
            raise RingClosed(f"ring {self.name} is closed")
        if self.role != "writer":
            raise IpcError("reserve() on the reading end")
        raise IpcError("commit() the previous reservation first")

    def notify(self) -> None:
        """Wake the reader (after commits made with ``notify=False``)."""
        self._data_bell.ring()

    def beat(self) -> None:
        """Writer: say this end's process is alive and its loop turning (one store into the
        header; wakes nobody). A reader that sees ``beats`` stand still for long knows the
        writer hangs (stopped, or stuck) although its process exists."""
        if not self._writable:
            self._raise_not_writable()
        self._words[W_BEAT] = (self._words[W_BEAT] + 1) & WRAP

    @property
    def beats(self) -> int:
        """Either end: the writer's beat count so far (see ``beat``)."""
        if self._closed:
            raise RingClosed(f"ring {self.name} is closed")
        return self._words[W_BEAT]

    def _wait_for_space(self, needed_read: int, timeout: float | None, block: bool) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        words = self._words
        while True:
            if words[W_READER_CLOSED]:
                raise PeerGone(f"the reader of ring {self.name} closed its end")
            self._rseen = words[W_READ_POS]
            if self._rseen >= needed_read:
                return
            if self._peer_gone():
                raise PeerGone(f"the reader of ring {self.name} (pid {self._peer_pid()}) died")
            if not block:
                raise WouldBlock(f"ring {self.name} is full")
            self._sleep(self._space_bell, deadline)

    # -- reader ---------------------------------------------------------------------------------
    def peek(self) -> memoryview | None:
        """A read-only-by-contract view of the oldest unreleased record, or None if empty.

        The view stays valid until ``release()``. Raises ``EndOfStream`` once the writer closed
        and everything was read, ``PeerGone`` once the writer died and everything was read.
        """
        head = self._head
        if head is not None:
            return head[0]
        if not self._readable:
            raise RingClosed(f"ring {self.name} is closed") if self._closed else \
                IpcError("peek() on the writing end")
        words = self._words
        cap = self._cap
        r = self._rpos
        while True:
            if r == self._wseen:
                self._wseen = words[W_WRITE_POS]
            if r == self._wseen:
                if words[W_WRITER_CLOSED]:
                    if r == words[W_WRITE_POS]:  # re-load: a commit may precede the close
                        raise EndOfStream(f"ring {self.name}: writer closed")
                    continue
                if self._peer_gone():
                    if r == words[W_WRITE_POS]:
                        raise PeerGone(f"the writer of ring {self.name} "
                                       f"(pid {self._peer_pid()}) died")
                    continue
                return None
            off = r % cap
            n = words[(HEADER_BYTES + off) >> 3]
            if n == WRAP:
                r += cap - off
                self._rpos = r
                words[W_READ_POS] = r
                continue
            if n > self.max_record_size:
                raise IpcError(f"ring {self.name} is corrupt: record length {n} at {r}")
            start = HEADER_BYTES + off + RECORD_HEADER
            view = self._buf[start:start + n]
            self._head = (view, RECORD_HEADER + ((n + ALIGN - 1) & -ALIGN))
            return view

    def recv(self, timeout: float | None = None) -> memoryview:
        """Like ``peek()`` but sleeps on the doorbell until a record arrives; ``ChannelTimeout``
        after ``timeout`` seconds (None: forever)."""
        view = self.peek()
        if view is not None:
            return view
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._sleep(self._data_bell, deadline)
            view = self.peek()
            if view is not None:
                return view

    async def recv_async(self) -> memoryview:
        """``recv()`` for asyncio: waits with ``loop.add_reader`` on the doorbell and peer.
        One waiter per ring end (a second concurrent waiter would replace the first's reader);
        wrap in ``asyncio.timeout`` for a deadline; cancellation is safe."""
        view = self.peek()
        while view is None:
            await self._sleep_async(self._data_bell)
            view = self.peek()
        return view

    def release(self) -> None:
        """Free the record returned by ``peek``/``recv``; its view must not be used after."""
        head = self._head
        if head is None:
            raise IpcError("release() without a record")
        self._head = None
        self._rpos += head[1]
        self._rcount += 1
        words = self._words
        words[W_READ_COUNT] = self._rcount
        words[W_READ_POS] = self._rpos
        self._space_bell.ring()

    # -- both ends ------------------------------------------------------------------------------
    def statistics(self) -> RingStatistics:
        """Bytes in use (records plus wrap padding), capacity, and records not yet released."""
        if self._closed:
            raise RingClosed(f"ring {self.name} is closed")
        w = self._words
        return RingStatistics(w[W_WRITE_POS] - w[W_READ_POS], self._cap,
                              w[W_WRITE_COUNT] - w[W_READ_COUNT])

    def wait_fds(self) -> tuple[int, ...]:
        """Waitable protocol: the reader wakes on the data bell, the writer on the space bell,
        both on the peer's death."""
        if self._closed:
            raise RingClosed(f"ring {self.name} is closed")
        bell = self._data_bell if self.role == "reader" else self._space_bell
        peer = self._peer()
        return (bell.fileno(),) + (peer.wait_fds() if peer is not None else ())

    def on_wake(self, fd: int) -> None:
        peer = self._peer()
        if peer is not None and fd in peer.wait_fds():
            peer.mark_dead()
        else:
            (self._data_bell if self.role == "reader" else self._space_bell).drain()

    @property
    def needs_liveness_slices(self) -> bool:
        peer = self._peer()
        return peer is not None and peer.needs_liveness_slices

    def close(self) -> None:
        """Close this end: the peer sees ``EndOfStream`` (after draining) or ``PeerGone``. The
        owner unlinks the segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._writable = self._readable = False
        self._head = None
        self._reserved = None
        self._finalizer.detach()
        self._res.release(warn=False)
        self._buf = self._words = None  # type: ignore[assignment]

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.role}, capacity {self._cap}"
        return f"Ring({self._shm.name!r}, {state})"

    # -- peer and sleeping ----------------------------------------------------------------------
    def _peer(self) -> Peer | None:
        """The peer to watch: the owner for an opener; for the owner, whoever attached (learnt
        from the header, replacing a ``watch_peer`` guess), or the guess until then."""
        peer = self._res.peer
        if not self._peer_settled and self._words is not None:
            pid = self._words[W_OPENER_PID]
            if pid:
                self._peer_settled = True
                if peer is None or peer.pid != pid:
                    if peer is not None:
                        peer.close()
                    peer = self._res.peer = Peer(pid)
        return peer

    def _peer_pid(self) -> int | None:
        peer = self._peer()
        return None if peer is None else peer.pid

    def _peer_gone(self) -> bool:
        peer = self._peer()
        return peer is not None and not peer.alive()

    def _sleep(self, bell: Doorbell, deadline: float | None) -> None:
        """Sleep until ``bell`` rings, the peer dies, or ``deadline``; the caller re-checks.

        Same as ``wait_any([bell, peer])`` with the poll set kept between calls (a sleep is on
        every hand-off when the reader keeps up, so its fixed cost is the wake-up latency)."""
        timeout = None
        if deadline is not None:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise ChannelTimeout(f"ring {self.name}: timed out")
        peer = self._peer()
        fds = (bell.fileno(),) + (peer.wait_fds() if peer is not None else ())
        if fds != self._poll_fds:
            self._poller = select.poll()
            for fd in fds:
                self._poller.register(fd, select.POLLIN)
            self._poll_fds = fds
        if peer is not None and peer.needs_liveness_slices:
            timeout = FALLBACK_SLICE_S if timeout is None else min(timeout, FALLBACK_SLICE_S)
        for fd, _ in self._poller.poll(-1 if timeout is None else int(timeout * 1000.0 + 0.999)):
            if fd == fds[0]:
                bell.drain()
            else:
                peer.mark_dead()

    async def _sleep_async(self, bell: Doorbell) -> None:
        loop = asyncio.get_running_loop()
        woke = loop.create_future()
        peer = self._peer()
        fds = (bell.fileno(),) + (peer.wait_fds() if peer is not None else ())

        def on_readable() -> None:
            if not woke.done():
                woke.set_result(None)

        for fd in fds:
            loop.add_reader(fd, on_readable)
        try:
            if peer is not None and peer.needs_liveness_slices:
                await asyncio.wait([woke], timeout=FALLBACK_SLICE_S)
            else:
                await woke
        finally:
            for fd in fds:
                loop.remove_reader(fd)
        bell.drain()


def _adopt(bell: Doorbell) -> Doorbell:
    """Take a doorbell from an opened spec: the unpickled one itself in a spawned process, a
    duplicate in-process (where the spec shares the owner's descriptors)."""
    if bell.unpickled and not bell.closed:
        bell.unpickled = False
        return bell
    return bell.dup()
