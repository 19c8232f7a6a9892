"""Admission by buffered audio: hold new work back while a playing stream runs low.

A fixed cap on running requests (`admission.max_running`) is right for one model, one text
length and one GPU at a time; past the pipeline's throughput every stream slows down together and
the ones already playing stall. This gate reads what a listener hears instead: a client that
plays a stream from its first chunk on, at real time, has `lead = t_first + audio_s - now`
seconds of audio left in its buffer (below zero: its player has stalled). While any counted stream
has less than `min_lead_s` left, queued requests wait: no new prefill takes the talker's step
time and no new first chunk takes the codec's, until the streams already playing are ahead again.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True)
class PlayoutGate:
    """Which playing streams run low on buffered audio, kept as the time each one's audio runs out.

    A stream counts once it has delivered `settle_s` seconds of audio (its first chunks are short
    by design, so its buffer starts small) and while its input is complete (a stream waiting for
    more text from its client is not late). `min_lead_s == 0` turns the gate off: it never holds.
    No I/O, no clock of its own: callers pass `now`.
    """

    min_lead_s: float
    settle_s: float
    _runs_out: dict[int, float] = field(default_factory=dict)  # rid -> when its audio runs out
    _heap: list[tuple[float, int]] = field(default_factory=list)  # (runs out, rid), may be stale

    @property
    def enabled(self) -> bool:
        return self.min_lead_s > 0

    def __len__(self) -> int:
        """Streams counted now."""
        return len(self._runs_out)

    def on_audio(self, rid: int, t_first: float, audio_s: float) -> None:
        """Stream `rid`, playing since `t_first`, has delivered `audio_s` seconds in all."""
        if not self.enabled or audio_s < self.settle_s:
            return
        runs_out = t_first + audio_s
        self._runs_out[rid] = runs_out
        heapq.heappush(self._heap, (runs_out, rid))
        if len(self._heap) > 4 * len(self._runs_out) + 64:  # stale entries: rebuild
            self._heap = [(t, r) for r, t in self._runs_out.items()]
            heapq.heapify(self._heap)

    def forget(self, rid: int) -> None:
        """`rid` ended, is being aborted, or waits for input: it no longer counts."""
        self._runs_out.pop(rid, None)

    def lowest_lead_s(self, now: float) -> float | None:
        """The smallest buffer of the counted streams at `now`; None when none counts."""
        heap = self._heap
        while heap and self._runs_out.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # superseded by a later chunk, or forgotten
        return heap[0][0] - now if heap else None

    def holding(self, now: float) -> bool:
        """True while some counted stream has less than `min_lead_s` of audio left at `now`."""
        if not self.enabled:
            return False
        lead = self.lowest_lead_s(now)
        return lead is not None and lead < self.min_lead_s
