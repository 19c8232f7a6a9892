"""Engine lifecycle as a small state machine: running → draining → stopped.

Signal handlers and `stop()` only call `request_stop()`, which sets the state and wakes whoever
waits; the coordinator does the work (abort or let requests finish) in its own task. `mode` comes
from the profile (`engine.shutdown`): "drain" lets running requests finish, "abort" ends them.
A failed stage moves the machine straight to `failed`, which also counts as stopped for waiters.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Literal


class EngineState(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


_ALLOWED = {
    EngineState.RUNNING: {EngineState.DRAINING, EngineState.FAILED},
    EngineState.DRAINING: {EngineState.STOPPED, EngineState.FAILED},
    EngineState.STOPPED: set(),
    EngineState.FAILED: {EngineState.STOPPED},
}


class Lifecycle:
    """The engine's state, its shutdown mode, and an event set whenever it changes."""

    def __init__(self, mode: Literal["drain", "abort"] = "drain") -> None:
        self.mode = mode
        self.state = EngineState.RUNNING
        self.reason: str | None = None
        self._changed = asyncio.Event()

    @property
    def accepting(self) -> bool:
        """New requests may be admitted."""
        return self.state is EngineState.RUNNING

    @property
    def healthy(self) -> bool:
        return self.state in (EngineState.RUNNING, EngineState.DRAINING)

    def request_stop(self) -> None:
        """Begin shutdown (idempotent; safe from a signal handler registered on the loop)."""
        if self.state is EngineState.RUNNING:
            self._move(EngineState.DRAINING)

    def fail(self, reason: str) -> None:
        """A stage died or broke: the engine can serve nothing more."""
        if self.state in (EngineState.RUNNING, EngineState.DRAINING):
            self.reason = reason
            self._move(EngineState.FAILED)

    def finish(self) -> None:
        """Draining found nothing left (or the engine failed): everything may be torn down."""
        if self.state in (EngineState.DRAINING, EngineState.FAILED):
            self._move(EngineState.STOPPED)

    async def wait_for(self, *states: EngineState) -> EngineState:
        """Wait until the state is one of `states`; returns it."""
        while self.state not in states:
            await self._changed.wait()
        return self.state

    def _move(self, new: EngineState) -> None:
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(f"engine state {self.state.value} -> {new.value} is not allowed")
        self.state = new
        changed, self._changed = self._changed, asyncio.Event()  # fresh event per change
        changed.set()
