"""A talker step's time on the GPU, and the GPU's idle time before it, from CUDA events.

The timelines time a step on the host (the runner's `step()` call). One step ahead
(`talker.overlap_steps`) that call holds the wait for the step before and not the host's work
done while the GPU computes the next, so it cannot say whether the GPU waited for the host.
Two timing events a step, recorded on the step's stream when its host work begins and after
its last device work, answer that: a step's span (first event to last) and the time from the
step before's last event to this one's first (the talker's stream idle, the host not yet
planning). Read once the step's results are back, so the events are complete and reading them
costs no wait. Kept off unless a timeline records.

Each step's marks travel with what it computed (decode rows, prompt tokens): one step ahead, the
call that launches a prefill step waits for the step before, so only the GPU's own span says what
a prefill step costs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class StepTime(NamedTuple):
    """One step as the GPU timed it, with what it computed (for the timeline's split of GPU time
    between decode rows and prompt tokens)."""

    idle_ms: float | None  # the talker's stream idle before it; None for the first step timed
    span_ms: float  # its first event to its last
    decode_rows: int  # rows it decoded (one token each)
    prefill_tokens: int  # prompt tokens it prefilled


class StepClock:
    """Marks each step's start and end on the current CUDA stream; `finished` turns a step's marks
    into a `StepTime`, `take` hands them over."""

    def __init__(self) -> None:
        self._last_end: torch.cuda.Event | None = None
        self._done: list[StepTime] = []

    @staticmethod
    def mark() -> torch.cuda.Event:
        """A timing event recorded now on the current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finished(self, start: torch.cuda.Event, end: torch.cuda.Event, batch: tuple[int, int] = (0, 0)) -> None:
        """A step whose results have been read, with its (decode rows, prefill tokens): its idle
        time and span. Steps must finish in the order they were launched."""
        end.synchronize()  # recorded after the step's last work: done, or about to be
        idle = self._last_end.elapsed_time(start) if self._last_end is not None else None
        self._done.append(StepTime(idle, start.elapsed_time(end), *batch))
        self._last_end = end

    def take(self) -> list[StepTime]:
        """The steps finished since the last call."""
        done, self._done = self._done, []
        return done
