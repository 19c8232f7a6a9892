"""Chunk policy: when the frames a talker emits for one request become a code chunk for the codec.

Schedule per request: a first chunk of `initial_frames` (1 by default, overridable per request, so
first audio comes after one frame), then the optional `ramp` sizes, then steady chunks of
`steady_frames` (15 = 1.2 s). When the request finishes, the frames still pending go out as the
final partial chunk; when nothing is pending the final record is empty (the terminal record).
When a request pauses for input, the frames pending go out at once (`flush`).

Pure logic, no I/O: the talker worker pushes one frame at a time and sends what comes back.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ChunkSchedule:
    """Sizes (in frames) of a request's chunks: initial, then ramp, then steady forever."""

    initial_frames: int = 1
    ramp: tuple[int, ...] = ()
    steady_frames: int = 15

    def __post_init__(self) -> None:
        sizes = (self.initial_frames, *self.ramp, self.steady_frames)
        if any(s < 1 for s in sizes):
            raise ValueError(f"chunk sizes must be >= 1, got initial={self.initial_frames} "
                             f"ramp={list(self.ramp)} steady={self.steady_frames}")

    def with_initial(self, initial_frames: int | None) -> ChunkSchedule:
        """This schedule with a per-request first-chunk size (None keeps the default)."""
        if initial_frames is None or initial_frames == self.initial_frames:
            return self
        return ChunkSchedule(initial_frames, self.ramp, self.steady_frames)

    def sizes(self) -> Iterator[int]:
        """The chunk sizes in order; infinite."""
        yield self.initial_frames
        yield from self.ramp
        while True:
            yield self.steady_frames


class ChunkAccumulator:
    """One request's pending frames; cuts them into chunks following a `ChunkSchedule`."""

    def __init__(self, schedule: ChunkSchedule, n_vq: int) -> None:
        self._sizes = schedule.sizes()
        self._target = next(self._sizes)
        self._n_vq = n_vq
        self._pending: list[np.ndarray] = []  # each [n_vq] int64
        self.frames_seen = 0
        self.chunks_cut = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def push(self, codes: np.ndarray) -> np.ndarray | None:
        """Add one frame (`[n_vq]` int64); returns a full chunk `[T, n_vq]` when the target is met."""
        self._pending.append(codes)
        self.frames_seen += 1
        if len(self._pending) < self._target:
            return None
        self._target = next(self._sizes)
        return self._take()

    def flush(self) -> np.ndarray:
        """The frames pending now as a chunk `[T, n_vq]` (T may be 0), the schedule unchanged: the
        request paused (its input ran out), so what it made so far is heard now."""
        return self._take() if self._pending else np.zeros((0, self._n_vq), dtype=np.int64)

    def finish(self) -> np.ndarray:
        """The final chunk `[T, n_vq]`: whatever is pending, possibly `T == 0` (terminal record)."""
        return self._take()

    def _take(self) -> np.ndarray:
        if self._pending:
            chunk = np.stack(self._pending).astype(np.int64, copy=False)  # [T, n_vq]
        else:
            chunk = np.zeros((0, self._n_vq), dtype=np.int64)
        self._pending = []
        self.chunks_cut += 1
        return chunk
