"""Doorbells: a file descriptor that one process makes readable to wake another.

Linux uses an ``eventfd`` (non-blocking, counter mode: many rings before a drain read as one);
elsewhere a non-blocking pipe. A sleeper waits with ``poll`` (``wait``, ``wait_any``) or from
asyncio with ``loop.add_reader``; nothing polls on a timer.

Lost wake-ups are ruled out by one rule on each side: the ringer rings *after* it changed the
shared state (commit, release, close), and the sleeper drains the bell *before* its last look at
that state, sleeping only if that look found nothing. Either the ring came before the drain, and
then the state change is visible to the look after it (the kernel's eventfd lock orders the two),
or it came after, and then the bell is readable when the sleeper polls. A stale ring costs one
spurious wake-up, never a missed one.

A doorbell crosses into a spawned process by pickling: ``multiprocessing.reduction.DupFd``
duplicates the descriptor for the child while it is being spawned (or via the resource sharer
when sent over a ``multiprocessing`` connection later).
"""

from __future__ import annotations

import asyncio
import os
import select
from collections.abc import Callable, Iterable
from multiprocessing.reduction import DupFd
from typing import Protocol

from ipc.peer import FALLBACK_SLICE_S

_HAS_EVENTFD = hasattr(os, "eventfd")


class Doorbell:
    """One bell: ``ring()`` from any process, ``wait()`` / ``drain()`` / ``add_to_loop`` to sleep."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._rfd = read_fd
        self._wfd = write_fd  # same as read_fd for an eventfd
        self._eventfd = read_fd == write_fd
        self.unpickled = False  # set on the copy a spawned process receives

    @classmethod
    def create(cls) -> Doorbell:
        """A new bell: an eventfd on Linux, a non-blocking pipe elsewhere."""
        if _HAS_EVENTFD:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            return cls(fd, fd)
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        return cls(r, w)

    def dup(self) -> Doorbell:
        """An independent handle on the same bell (its own descriptors)."""
        rfd = os.dup(self._rfd)
        return Doorbell(rfd, rfd if self._wfd == self._rfd else os.dup(self._wfd))

    @property
    def closed(self) -> bool:
        return self._rfd < 0

    def fileno(self) -> int:
        """The descriptor that becomes readable when the bell has rung."""
        return self._rfd

    def ring(self) -> None:
        """Make the bell readable. Cheap (one syscall); never blocks."""
        try:
            if self._eventfd:
                os.eventfd_write(self._wfd, 1)
            else:
                os.write(self._wfd, b"\x01")
        except BlockingIOError:  # pipe full or counter saturated: it is readable already
            pass

    def drain(self) -> bool:
        """Consume every pending ring without blocking; True if there was one."""
        try:
            if self._rfd == self._wfd:
                os.eventfd_read(self._rfd)
                return True
            rang = False
            while os.read(self._rfd, 4096):
                rang = True
            return rang
        except BlockingIOError:
            return False

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until the bell rings or ``timeout`` seconds pass; drains it. True if it rang."""
        return bool(wait_any([self], timeout))

    async def wait_async(self) -> None:
        """Await the next ring on the running asyncio loop (``add_reader``); drains it."""
        loop = asyncio.get_running_loop()
        rang = loop.create_future()
        loop.add_reader(self._rfd, lambda: rang.done() or rang.set_result(None))
        try:
            await rang
        finally:
            loop.remove_reader(self._rfd)
        self.drain()

    def add_to_loop(self, loop, callback: Callable[[], None]) -> None:
        """Call ``callback()`` from ``loop`` whenever the bell rings (after draining it)."""

        def on_readable() -> None:
            self.drain()
            callback()

        loop.add_reader(self._rfd, on_readable)

    def remove_from_loop(self, loop) -> None:
        loop.remove_reader(self._rfd)

    # -- Waitable ---------------------------------------------------------------------------
    def wait_fds(self) -> tuple[int, ...]:
        return (self._rfd,)

    def on_wake(self, fd: int) -> None:
        self.drain()

    def close(self) -> None:
        """Close the descriptors (idempotent)."""
        if self._rfd >= 0:
            os.close(self._rfd)
            if self._wfd != self._rfd:
                os.close(self._wfd)
        self._rfd = self._wfd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:  # already closed behind our back; nothing left to release
            pass

    def __reduce__(self):
        if self._rfd < 0:
            raise ValueError("cannot pickle a closed Doorbell")
        if self._rfd == self._wfd:
            return (_rebuild_doorbell, (DupFd(self._rfd), None))
        return (_rebuild_doorbell, (DupFd(self._rfd), DupFd(self._wfd)))

    def __repr__(self) -> str:
        return f"Doorbell(fd={self._rfd})"


def _rebuild_doorbell(read_dup, write_dup) -> Doorbell:
    rfd = read_dup.detach()
    wfd = rfd if write_dup is None else write_dup.detach()
    bell = Doorbell(rfd, wfd)
    bell.unpickled = True
    return bell


class Waitable(Protocol):
    """Anything ``wait_any`` can sleep on: doorbells, peers, rings, channels."""

    def wait_fds(self) -> tuple[int, ...]:
        """Descriptors whose readability means "look at me"; empty if none now."""

    def on_wake(self, fd: int) -> None:
        """Called for each of its descriptors found readable (drain a bell, note a death)."""


def wait_any(waitables: Iterable[Waitable], timeout: float | None = None) -> list[Waitable]:
    """Sleep until one of ``waitables`` is ready or ``timeout`` (seconds; None = forever) passes.

    Returns the ready ones, each already told via ``on_wake`` (bells drained). The caller then
    looks at their state (``try_recv`` until None); anything committed after the drain rings
    again, so the next ``wait_any`` wakes. A waitable whose peer cannot be watched by descriptor
    (no pidfd) limits the sleep to ``FALLBACK_SLICE_S``.
    """
    by_fd: dict[int, list[Waitable]] = {}
    poller = select.poll()
    for w in waitables:
        for fd in w.wait_fds():
            if fd not in by_fd:
                poller.register(fd, select.POLLIN)
            by_fd.setdefault(fd, []).append(w)
        if getattr(w, "needs_liveness_slices", False):
            timeout = FALLBACK_SLICE_S if timeout is None else min(timeout, FALLBACK_SLICE_S)
    if timeout is None:
        ms = -1
    else:
        ms = max(0, int(timeout * 1000.0 + 0.999))  # round up: never wake before the deadline
    ready: list[Waitable] = []
    while True:
        try:
            events = poller.poll(ms)
            break
        except InterruptedError:  # PEP 475 retries poll itself; kept for clarity on old builds
            continue
    for fd, _ in events:
        for w in by_fd[fd]:
            w.on_wake(fd)
            if w not in ready:
                ready.append(w)
    return ready
