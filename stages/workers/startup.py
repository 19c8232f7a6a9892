"""A worker's start-up as it goes, and where its time went.

`StartupLog` times a worker from its spawn to its Ready in the phases of
`ipc.messages.StartupTimes`: the worker marks its load, warm-up and capture spans (`phase`);
compile is torch.compile's own time wherever it ran (taken out of the span it ran in); start is
the rest (the process, imports, CUDA's context, the memory plan). So the phases add up to the
total. Each compile is one log line (`CompileLog`: which function, why again, its seconds, what
the worker was doing), written once dynamo has recorded it: when the next compile starts, when a
span ends, or with a capture's progress line (`capture_progress`). The worker sends the breakdown
in its Ready (the launcher logs every worker's in one line) and logs it itself (`describe`).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from ipc.messages import StartupTimes
from stages.runtime.graph_capture import CaptureProgress

log = logging.getLogger(__name__)

Phase = Literal["load", "warm-up", "capture"]
REASON_CHARS = 160  # of dynamo's reason for a compile again, in its line


class CompileLog:
    """torch.compile's compiles in this process, one line each to `report`, with their count and
    seconds so far. Read from dynamo's own records of them
    (`torch._dynamo.utils.get_compilation_metrics`, kept for the last 64), once torch.compile has
    been used (dynamo is not imported here: about a second of import for a worker that compiles
    nothing)."""

    def __init__(self, stage: str, report: Callable[[str], None]) -> None:
        self.stage, self.report = stage, report
        self.count = 0
        self.seconds = 0.0
        self.doing = "start-up"  # what the worker is doing, named in each line
        utils = sys.modules.get("torch._dynamo.utils")
        before = utils.get_compilation_metrics() if utils is not None else []
        self._last: Any = before[-1] if before else None  # the last record read (earlier ones are not ours)
        self._hooked: Any = None  # dynamo's callback handler, once this log is hooked in

    def flush(self) -> None:
        """Log the compiles dynamo has recorded since the last call."""
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return
        self._hook(sys.modules.get("torch._dynamo.callback"))
        records = utils.get_compilation_metrics()
        start = next((i + 1 for i in range(len(records) - 1, -1, -1) if records[i] is self._last), 0)
        for record in records[start:]:
            self._log(record)
        if records:
            self._last = records[-1]

    def _log(self, record: Any) -> None:
        if getattr(record, "co_name", "?") is None:  # a record of no frame's compile (on a GPU: one
            return                                    # after most frames', 0.0 s): not a compile
        seconds = (getattr(record, "entire_frame_compile_time_s", None)
                   or (getattr(record, "duration_us", None) or 0) / 1e6)
        self.count += 1
        self.seconds += seconds
        why = getattr(record, "recompile_reason", None) or ""
        again = f"; again: {why[:REASON_CHARS]}" if why else ""
        failed = getattr(record, "fail_type", None)
        self.report(f"{self.stage}: compile {self.count}: {getattr(record, 'co_name', '?')} in {seconds:.1f} s, "
                    f"during {self.doing}{again}{f'; failed: {failed}' if failed else ''}")

    def _hook(self, callback: Any) -> None:
        """Once: flush at the start of every later compile, so each compile's line comes as the
        next one begins rather than at the end of the span."""
        if self._hooked is not None or callback is None:
            return
        self._hooked = callback.callback_handler
        self._hooked.register_start_callback(self._on_compile_start)

    def _on_compile_start(self, *_args: Any) -> None:
        """Dynamo's start-of-compile callback (with its arguments or, in older torch, none): a
        failure here must not fail the compile, so it is only logged."""
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - the compile goes on; the line comes at the span's end
            log.exception("%s: the compile log could not read dynamo's records", self.stage)

    def close(self) -> None:
        if self._hooked is not None:
            self._hooked.remove_start_callback(self._on_compile_start)
            self._hooked = None


@dataclass
class Span:
    """One marked span: its wall seconds and the compiles in it (set when it ends)."""

    seconds: float = 0.0
    compiles: int = 0
    compile_seconds: float = 0.0


class StartupLog:
    """A worker's start-up phases (module docstring); `report` takes each line (the worker's
    `log.info`), `stage` begins them ("talker", "codec"); `began`: the wall-clock time of the
    worker's spawn (`WorkerSpec.spawned_at`; None: now)."""

    def __init__(self, stage: str, report: Callable[[str], None], began: float | None = None) -> None:
        self.stage, self.report = stage, report
        # its start on this clock: the phases are perf_counter spans
        self._t0 = time.perf_counter() - (max(0.0, time.time() - began) if began is not None else 0.0)
        self.seconds: dict[Phase, float] = {"load": 0.0, "warm-up": 0.0, "capture": 0.0}
        self.graphs = 0
        self.compiles = CompileLog(stage, report)

    @contextmanager
    def phase(self, name: Phase, doing: str) -> Iterator[Span]:
        """Mark a span of phase `name`; `doing` names it in the compile lines. The span (yielded)
        has its seconds and compiles once it ends; its compile time goes to the compile phase."""
        self.compiles.flush()  # anything compiled before belongs to what came before
        self.compiles.doing = doing
        span, t0 = Span(), time.perf_counter()
        count, compiled = self.compiles.count, self.compiles.seconds
        try:
            yield span
        finally:
            self.compiles.flush()
            span.seconds = time.perf_counter() - t0
            span.compiles = self.compiles.count - count
            span.compile_seconds = self.compiles.seconds - compiled
            self.seconds[name] += span.seconds - span.compile_seconds
            self.compiles.doing = "start-up"

    def capture_progress(self, what: str) -> CaptureProgress:
        """A `CaptureProgress` whose lines begin with this stage and `what` and come after the
        compile lines recorded by then; its graphs are counted in `graphs` at `finish_capture`."""
        return CaptureProgress(f"{self.stage}: {what}", self._progress_line)

    def finish_capture(self, progress: CaptureProgress) -> None:
        """The capture's last line; its graphs count as recorded ahead."""
        progress.finish()
        self.graphs += progress.made

    def capture(self, what: str, capture: Callable[[CaptureProgress], int]) -> int:
        """`capture(progress)` (a runner's capture call) planned, then made in the capture phase
        with a progress line every tenth or 10 s; how many graphs it made (no line when it plans
        none)."""
        progress = self.capture_progress(what)
        if not progress.plan(capture):
            return 0
        with self.phase("capture", f"the capture of {what}"):
            made = capture(progress)
        self.finish_capture(progress)
        return made

    def _progress_line(self, line: str) -> None:
        self.compiles.flush()
        self.report(line)

    def times(self) -> StartupTimes:
        """The breakdown up to now (call it just before Ready)."""
        self.compiles.flush()
        total = time.perf_counter() - self._t0
        compile_s = self.compiles.seconds
        start = total - compile_s - sum(self.seconds.values())
        return StartupTimes(total=total, start=start, load=self.seconds["load"], compile=compile_s,
                            capture=self.seconds["capture"], warm_up=self.seconds["warm-up"],
                            compiles=self.compiles.count, graphs=self.graphs)

    def close(self) -> None:
        self.compiles.close()


def describe(times: StartupTimes) -> str:
    """'202.1 s: start 3.1 s, load 10.2 s, compile 167.3 s (11 compiles), capture 15.1 s (312
    graphs), warm-up 6.4 s': the phases add up to the total."""
    return (f"{times.total:.1f} s: start {times.start:.1f} s, load {times.load:.1f} s, compile "
            f"{times.compile:.1f} s ({times.compiles} compiles), capture {times.capture:.1f} s "
            f"({times.graphs} graphs), warm-up {times.warm_up:.1f} s")
