"""A process's timeline: what its loop did and when, as JSON lines, for finding where time goes.

With `engine.timeline_dir` set, the talker and codec workers and each API process's engine
client (its submits and PCM arrivals) each write one file `<dir>/<name>-<pid>.jsonl`; `python -m bench.timeline <dir>` reads them together and
prints where a serving pass spent its time (docs/performance.md shows how it is used).

A line is one event: `{"k": kind, "t": start, ...fields}`. Times are `time.monotonic()` seconds,
CLOCK_MONOTONIC, one clock for every process of the machine, so files merge without offsets.
Events are kept in memory and written in batches: adding one is a list append, cheap enough for
a worker's hot loop (a few per step or dispatch, a few per request).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

FLUSH_EVERY = 4096  # events held before a write


class Timeline:
    """Append-only event log of one process; `close()` (or every `FLUSH_EVERY` events) writes it."""

    def __init__(self, directory: str | os.PathLike, name: str) -> None:
        path = Path(directory).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"{name}-{os.getpid()}.jsonl"
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        self._events: list[dict[str, Any]] = []
        self._encoder = msgspec.json.Encoder()

    def add(self, kind: str, t: float, **fields: Any) -> None:
        """One event of `kind` at monotonic time `t` (its start, for spans) with its fields."""
        fields["k"], fields["t"] = kind, round(t, 6)
        self._events.append(fields)
        if len(self._events) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._events and self._file is not None:
            self._file.write(self._encoder.encode_lines(self._events))
            self._file.flush()
        self._events.clear()

    def close(self) -> None:
        """Write what is held and close the file. Idempotent."""
        if self._file is None:
            return
        self.flush()
        self._file.close()
        self._file = None


def open_timeline(directory: str | None, name: str) -> Timeline | None:
    """A `Timeline` under `directory`, or None when timelines are off (`directory` is None)."""
    return None if directory is None else Timeline(directory, name)


def read_events(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """Every event of every file under `directory`, each with `"src"` (its file's process name),
    sorted by time."""
    events = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        source = path.stem.rsplit("-", 1)[0]
        for line in path.read_bytes().splitlines():
            if line.strip():
                event = msgspec.json.decode(line)
                event["src"] = source
                events.append(event)
    events.sort(key=lambda e: e["t"])
    return events
