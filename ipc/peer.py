"""Peer-process liveness: a handle that becomes readable when a process exits.

On Linux it is a pidfd (``os.pidfd_open``), which a ``poll`` can wait on next to a doorbell, so a
dead peer wakes a sleeping reader or writer at once. Where pidfd is missing, ``fileno()`` is None
and callers wait in slices of ``FALLBACK_SLICE_S`` and ask ``alive()`` (``kill(pid, 0)``) between
them: bounded detection, at the cost of that one timer.
"""

from __future__ import annotations

import os
import select

FALLBACK_SLICE_S = 0.1


class Peer:
    """Watches one process by pid. A pid that is already gone counts as dead."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        self._dead = False
        if hasattr(os, "pidfd_open"):
            try:
                self._fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._dead = True
            except OSError:  # e.g. seccomp or an old kernel: use the fallback
                self._fd = None

    def fileno(self) -> int | None:
        """The pidfd (readable once the process has exited), or None on the fallback path."""
        return self._fd

    def alive(self) -> bool:
        """Whether the process still runs (a zombie counts as dead). Sticky once dead."""
        if self._dead:
            return False
        if self._fd is not None:
            p = select.poll()
            p.register(self._fd, select.POLLIN)
            self._dead = bool(p.poll(0))
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._dead = True
            except PermissionError:
                pass
        return not self._dead

    def mark_dead(self) -> None:
        """Record that the pidfd was seen readable."""
        self._dead = True

    # -- Waitable (see ipc.doorbell.wait_any) -------------------------------------------------
    @property
    def needs_liveness_slices(self) -> bool:
        """True on the fallback path: a sleeper must wake now and then to ask ``alive()``."""
        return self._fd is None and not self._dead

    def wait_fds(self) -> tuple[int, ...]:
        return () if self._fd is None else (self._fd,)

    def on_wake(self, fd: int) -> None:
        self._dead = True

    def close(self) -> None:
        """Close the pidfd."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
