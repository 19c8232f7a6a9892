"""Coalescing window of the codec worker: when to dispatch a decode batch, and which streams go in.

A stream is *ready* while it has at least one code chunk waiting. The codec decodes at most one
chunk per stream per batch (streaming decode is sequential within a stream). Rules:

- dispatch when at least `min_batch` streams are ready (a target, not a cap; `max_batch` caps);
- or when a ready chunk is due: by default `max_wait_s` after it arrived; the caller may give a
  later due time to a chunk that can wait (its stream has audio buffered at its client), so such
  chunks gather into larger, cheaper dispatches while urgent ones keep the short window;
- policy `idle_wait` (default) also dispatches at once when no more streams could join
  (every alive stream is ready, or fewer streams are alive than `min_batch`), and the worker sleeps
  on its doorbells without a timeout while nothing is ready;
- policy `fixed` keeps the window fixed: without `min_batch` ready streams it always waits the
  full `max_wait_s` from the oldest ready chunk, whatever the number of alive streams.

Pure logic: the caller passes the clock, so tests need no sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["fixed", "idle_wait"]


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do now: decode these streams (oldest first), or wait up to `wait_s` (None = no limit)."""

    dispatch: tuple[int, ...] = ()
    wait_s: float | None = None


@dataclass(slots=True)
class Coalescer:
    """Tracks ready streams and decides dispatches. One instance per codec worker."""

    min_batch: int = 1
    max_wait_s: float = 0.0
    max_batch: int = 1 << 30
    policy: Policy = "idle_wait"
    _ready_since: dict[int, float] = field(default_factory=dict)  # rid -> arrival of oldest chunk
    _due: dict[int, float] = field(default_factory=dict)  # rid -> latest dispatch time of that chunk

    def __post_init__(self) -> None:
        if self.min_batch < 1 or self.max_batch < self.min_batch:
            raise ValueError(f"coalescing: need 1 <= min_batch <= max_batch, got "
                             f"min_batch={self.min_batch} max_batch={self.max_batch}")
        if self.max_wait_s < 0:
            raise ValueError(f"coalescing: max_wait must be >= 0, got {self.max_wait_s}")
        if self.policy not in ("fixed", "idle_wait"):
            raise ValueError(f"coalescing: unknown policy {self.policy!r} (fixed | idle_wait)")

    @property
    def num_ready(self) -> int:
        return len(self._ready_since)

    def mark_ready(self, rid: int, since: float, due: float | None = None) -> None:
        """Stream `rid` has a chunk waiting since `since`, to be dispatched by `due` (default
        `since + max_wait_s`); a no-op when it is already ready.

        After a dispatch took its chunk, the caller marks it again with the arrival time of its
        next waiting chunk, so a backlog is not held for another window.
        """
        if rid not in self._ready_since:
            self._ready_since[rid] = since
            self._due[rid] = since + self.max_wait_s if due is None else due

    def take(self, rids: tuple[int, ...]) -> None:
        """These streams are dispatched outside `decide` (express first chunks): not ready now."""
        for rid in rids:
            self.forget(rid)

    def forget(self, rid: int) -> None:
        """Stream `rid` has nothing waiting any more (dispatched, aborted or closed)."""
        self._ready_since.pop(rid, None)
        self._due.pop(rid, None)

    def wait_time(self, now: float, alive: int) -> float | None:
        """Seconds until a dispatch is due: 0 = now, None = nothing ready. Changes nothing."""
        ready = self._ready_since
        if not ready:
            return None
        target = self.min_batch
        if self.policy == "idle_wait":
            target = max(1, min(target, alive))
        due = min(self._due.values())
        if len(ready) >= target or now >= due:
            return 0.0
        return due - now

    def decide(self, now: float, alive: int) -> Decision:
        """Dispatch now (the chosen streams leave the ready set) or wait; `alive` counts open
        streams (ready or not)."""
        wait = self.wait_time(now, alive)
        if wait != 0.0:
            return Decision(wait_s=wait)
        ready = self._ready_since
        order = sorted(ready, key=ready.__getitem__)[: self.max_batch]
        for rid in order:
            self.forget(rid)
        return Decision(dispatch=tuple(order))
