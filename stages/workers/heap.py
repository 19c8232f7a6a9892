"""The Python heap of a serving process: frozen once the process is warm, its collections timed.

A warm worker holds a few hundred thousand long-lived objects (the model's modules, compiled
kernels and their guards, the captured graphs' bookkeeping). Python's generation-2 collection
walks every one of them, and a burst of new requests (many allocations at once) is what starts
one: a stall of hundreds of milliseconds in a process whose step takes ~15 ms, at the moment first
audio matters most. `freeze_heap` moves everything alive at the end of warm-up out of the
collector's reach (`gc.freeze`); what serving allocates is still collected, in short walks.
`thaw_heap` gives them back at the end, so the interpreter's last collections at exit free them:
a frozen object outlives the exit, and C extensions that count their live objects then (Triton's
nanobind bindings print "leaked ... instances" for each) would report every one still held.
`GcPauses` times every collection, so a long one is logged and a slow step can say it met one.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

LONG_PAUSE_S = 0.05  # a collection this long is logged


def freeze_heap() -> int:
    """Collect once, then freeze every object alive (they are never walked again); how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Return what `freeze_heap` froze to the collector (the process is stopping)."""
    gc.unfreeze()


class GcPauses:
    """Times every garbage collection of this process (`gc.callbacks`) from construction to
    `close()`: `seconds` and `collections` so far; a collection over `log_over_s` is logged
    with its generation, tagged `name`."""

    def __init__(self, name: str, log_over_s: float = LONG_PAUSE_S) -> None:
        self.name, self.log_over_s = name, log_over_s
        self.seconds, self.collections = 0.0, 0
        self._started: float | None = None
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # registered during a collection
            return
        took, self._started = time.perf_counter() - self._started, None
        self.seconds += took
        self.collections += 1
        if took > self.log_over_s:
            log.warning("%s: a garbage collection (generation %d, %d objects freed) paused the process "
                        "for %.0f ms", self.name, info.get("generation", -1), info.get("collected", 0), took * 1e3)

    def close(self) -> None:
        """Stop timing (the callback leaves `gc.callbacks`)."""
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
