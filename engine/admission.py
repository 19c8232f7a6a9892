"""Admission control: run now, wait in the bounded queue, or reject with a retry-after estimate."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    RUN = "run"        # dispatch to the talker now
    QUEUE = "queue"    # wait for a running request to end
    REJECT = "reject"  # queue full: typed rejection with a retry-after hint


@dataclass(slots=True)
class Admission:
    """At most `max_running` requests in the workers, at most `max_queued` waiting.

    The retry-after hint estimates when a queue place frees up: the mean service time (an
    exponential moving average over finished requests) times the queue rounds ahead of a newcomer.
    """

    max_running: int
    max_queued: int
    default_retry_after_s: float = 1.0
    smoothing: float = 0.2
    _mean_service_s: float | None = None

    def decide(self, num_running: int, num_queued: int, *, hold: bool = False) -> Verdict:
        """`hold`: new work waits even with a place free (the playout gate, `engine.playout_gate`)."""
        if num_running < self.max_running and num_queued == 0 and not hold:
            return Verdict.RUN
        if num_queued < self.max_queued:
            return Verdict.QUEUE
        return Verdict.REJECT

    def may_dispatch(self, num_running: int, *, hold: bool = False) -> bool:
        """A queued request may start (a running one ended, or the playout gate opened)."""
        return num_running < self.max_running and not hold

    def record_service_time(self, seconds: float) -> None:
        """A request ended after `seconds` in the workers."""
        if self._mean_service_s is None:
            self._mean_service_s = seconds
        else:
            self._mean_service_s += self.smoothing * (seconds - self._mean_service_s)

    def retry_after_s(self, num_queued: int) -> float:
        """Seconds until a rejected client should retry (never below 0.1 s)."""
        if self._mean_service_s is None:
            return self.default_retry_after_s
        rounds = (num_queued + 1) / self.max_running
        return max(0.1, round(self._mean_service_s * rounds, 3))
