"""Figures of `mossvox bench serve`: per-request player simulation, per-run summary, the printed
table, the JSON document and the progress line.

Definitions (all times from the client's clock, ``time.perf_counter``):

- TTFA: from sending the request to the first non-empty body chunk.
- latency: from sending to the last body byte; RTF = latency / audio seconds of that request.
- audio seconds: PCM bytes received / (sample_rate * channels * 2).
- inter-chunk gap: time between two successive bursts of body bytes of one request; reads that
  arrive within 2 ms of the previous one are the same burst (a socket hands one server chunk of
  460 KB over in several reads).
- player: starts playing at the first byte and plays at real time; when the next byte it needs
  has not arrived it stalls until it does. Underrun = the summed stall time of a request; a
  request is "smooth" when no single stall is longer than 100 ms. For the streams that are not,
  the run's ``stalls`` says when in the pass their longest stall ended and after how much audio
  (many streams stalling at one moment: one event in the server).
- audio-s/s = all audio seconds of the pass / the pass's wall time (first send to last byte);
  requests/s likewise. With several client processes (``--client-procs``) their records are
  merged first: the wall time runs from the first send in any process to the last byte in any
  process (perf_counter is one system-wide clock), and every figure is over all requests.
- full load: audio seconds that arrived while every client had a request in flight (from the
  first wave's last first audio to the first client's last byte) / that window. A closed loop's
  tail (clients done one by one, the last requests decoding in ever smaller batches) lasts about
  one request: at 3 prompts a client about a quarter of the wall time, at 1088 prompts (the
  Seed-TTS EN set, as peers publish) about a tenth at C=128. The pass's own figure stays the
  headline; this one is what the pipeline sustains.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

SMOOTH_GAP_S = 0.1
BURST_S = 0.002


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds from its send)."""

    index: int
    utt_id: str
    target_chars: int
    forced_frames: int | None
    ok: bool = False
    error: str | None = None
    status: int | None = None
    start_s: float = 0.0  # send time, from the start of the pass
    ttfa_s: float | None = None
    latency_s: float | None = None
    audio_bytes: int = 0
    audio_s: float = 0.0
    chunk_at_s: list[float] = field(default_factory=list)  # arrival of each non-empty chunk
    chunk_bytes: list[int] = field(default_factory=list)
    ref_cache: str | None = None  # the server's X-Ref-Cache header (hit / miss)
    ignored_fields: str | None = None  # the server's X-Ignored-Fields header ("ref_text, ...")


@dataclass(frozen=True)
class PlayerStats:
    underrun_s: float  # summed stall time
    max_stall_s: float  # longest single stall
    max_stall_end_s: float = 0.0  # when it ended (the late chunk came), from the request's send
    max_stall_after_s: float = 0.0  # seconds of audio played before it

    @property
    def smooth(self) -> bool:
        return self.max_stall_s <= SMOOTH_GAP_S


def simulate_player(chunk_at_s: list[float], chunk_bytes: list[int], bytes_per_s: float) -> PlayerStats:
    """A real-time player that starts at the first chunk: each chunk must arrive before the
    audio before it has played out, else the player stalls until it does."""
    if not chunk_at_s:
        return PlayerStats(0.0, 0.0)
    stalled = longest = longest_end = longest_after = received = 0.0
    played_until = chunk_at_s[0]  # wall time at which the audio received so far runs out
    for at, size in zip(chunk_at_s, chunk_bytes):
        stall = max(0.0, at - played_until)
        stalled += stall
        if stall > longest:
            longest, longest_end, longest_after = stall, at, received
        played_until = max(played_until, at) + size / bytes_per_s
        received += size / bytes_per_s
    return PlayerStats(stalled, longest, longest_end, longest_after)


def stall_moments(results: list[RequestResult], players: list[PlayerStats], concurrency: int) -> dict:
    """Where the streams that were not smooth stalled: how many (and of the first wave), when in
    the pass their longest stall ended and after how much audio (each as [value, streams], the
    most frequent first, at most three). Streams stalling together at one moment point to one
    event in the server; stalls after the first chunk's audio, to a first wave's burst."""
    first_wave = {id(r) for r in sorted(results, key=lambda r: r.start_s)[:concurrency]}
    late = [(r, p) for r, p in zip(results, players) if not p.smooth]

    def common(values: list[float]) -> list[list[float]]:
        return [[v, n] for v, n in Counter(values).most_common(3)]

    return {"streams": len(late), "first_wave": sum(id(r) in first_wave for r, _ in late),
            "at_s": common([round(r.start_s + p.max_stall_end_s, 1) for r, p in late]),
            "after_audio_s": common([round(p.max_stall_after_s, 2) for _, p in late])}


def burst_gaps(chunk_at_s: list[float], within_s: float = BURST_S) -> list[float]:
    """Gaps between bursts: reads closer than ``within_s`` to the previous read join its burst."""
    return [b - a for a, b in zip(chunk_at_s, chunk_at_s[1:]) if b - a >= within_s]


def _stats(values: list[float], scale: float = 1.0, digits: int = 2) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None, "max": None}
    v = np.asarray(values, dtype=float) * scale
    return {"mean": round(float(v.mean()), digits), "p50": round(float(np.percentile(v, 50)), digits),
            "p99": round(float(np.percentile(v, 99)), digits), "max": round(float(v.max()), digits)}


def summarize(concurrency: int, results: list[RequestResult], wall_s: float, bytes_per_s: float,
              *, warmup: dict | None = None, client_cpu_s: float | None = None,
              client_cpu_max_s: float | None = None, client_procs: int = 1) -> dict:
    """One run's figures (the JSON ``runs[]`` entry); ``failed`` when any request failed.
    ``client_cpu_s``: the client processes' CPU time over the pass, summed over ``client_procs``
    processes (and the parent that merges their records, when there are several);
    ``client_cpu_max_s``: the busiest one's (default: ``client_cpu_s``). The busiest process's
    CPU near ``wall_s`` means the client, not the server, was the limit."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    players = [simulate_player(r.chunk_at_s, r.chunk_bytes, bytes_per_s) for r in ok]
    gaps = [g for r in ok for g in burst_gaps(r.chunk_at_s)]
    audio_total = sum(r.audio_s for r in ok)
    run = {
        "concurrency": concurrency,
        "failed": bool(failed) or not results or bool(warmup and warmup["num_failed"]),
        "num_requests": len(results),
        "num_failed": len(failed),
        "wall_s": round(wall_s, 4),
        "audio_s_total": round(audio_total, 3),
        "audio_s_per_s": round(audio_total / wall_s, 3) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "full_load": full_load(ok, concurrency, len(results), bytes_per_s),
        "mean_in_flight": round(sum(r.latency_s for r in ok) / wall_s, 2) if wall_s > 0 else None,
        "ttfa_ms": _stats([r.ttfa_s for r in ok], 1000, 1),
        "ttfa_after_first_wave_ms": _stats([r.ttfa_s for r in after_first_wave(ok, concurrency)], 1000, 1),
        "latency_s": _stats([r.latency_s for r in ok], 1, 3),
        "rtf": _stats([r.latency_s / r.audio_s for r in ok], 1, 4),
        "audio_s_per_request": _stats([r.audio_s for r in ok], 1, 3),
        "chunk_gap_ms": _stats(gaps, 1000, 1),
        "underrun_s": {**_stats([p.underrun_s for p in players], 1, 4),
                       "total": round(sum(p.underrun_s for p in players), 4)},
        "max_stall_ms": _stats([p.max_stall_s for p in players], 1000, 1),
        "share_smooth": round(sum(p.smooth for p in players) / len(results), 4) if results else 0.0,
        "stalls": stall_moments(ok, players, concurrency),
        "ref_cache_hits": sum(r.ref_cache == "hit" for r in ok),
        "ref_cache_lookups": sum(r.ref_cache in ("hit", "miss") for r in ok),
        "ignored_fields": _ignored(ok),
        "errors": [f"{r.utt_id}: {r.error}" for r in failed[:10]],
        "client_cpu_s": None if client_cpu_s is None else round(client_cpu_s, 3),
        "client_cpu_max_s": (None if client_cpu_s is None else
                             round(client_cpu_s if client_cpu_max_s is None else client_cpu_max_s, 3)),
        "client_procs": client_procs,
        "warmup": warmup,
        "requests": [{**asdict(r), "max_stall_ms": round(1000 * p.max_stall_s, 2),
                      "underrun_s": round(p.underrun_s, 4)}
                     for r, p in zip(ok, players)] + [asdict(r) for r in failed],
    }
    return run


def after_first_wave(results: list[RequestResult], concurrency: int) -> list[RequestResult]:
    """The requests sent after the pass's first `concurrency` (each closed-loop client's first
    request leaves at the start, together): first audio without the opening burst, which a
    short pass weighs heavily (3 prompts a client: a third of the requests)."""
    return sorted(results, key=lambda r: r.start_s)[concurrency:]


def full_load(results: list[RequestResult], concurrency: int, sent: int,
              bytes_per_s: float) -> dict | None:
    """Audio-s/s while all `concurrency` clients had a request in flight: bytes that arrived after
    the first wave's last first audio, up to the end of the first request with no successor (the
    closed loop sends a new request as each one ends until `sent` are out, so the
    (sent - concurrency + 1)-th end is the first after which a client stays idle). None when
    the pass has no such window (one request a client, a failed request, or no audio yet)."""
    if sent <= concurrency or len(results) != sent or any(r.ttfa_s is None for r in results):
        return None
    first_wave = sorted(results, key=lambda r: r.start_s)[:concurrency]
    start = max(r.start_s + r.ttfa_s for r in first_wave)
    end = sorted(r.start_s + r.latency_s for r in results)[sent - concurrency]
    if end <= start:
        return None
    received = sum(size for r in results for at, size in zip(r.chunk_at_s, r.chunk_bytes)
                   if start < r.start_s + at <= end)
    return {"window_s": [round(start, 4), round(end, 4)],
            "audio_s_per_s": round(received / bytes_per_s / (end - start), 3)}


def _ignored(results: list[RequestResult]) -> dict[str, int]:
    """Requests whose field the server ignored, per field (e.g. {"ref_text": 8})."""
    counts: dict[str, int] = {}
    for r in results:
        for name in filter(None, (part.strip() for part in (r.ignored_fields or "").split(","))):
            counts[name] = counts.get(name, 0) + 1
    return counts


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(runs: list[dict]) -> str:
    """The printed table, one row per run (markdown, so it pastes into docs/performance.md)."""
    head = ("| C | requests | failed | wall s | audio-s/s | req/s | TTFA mean | TTFA p50 | TTFA p99 "
            "| RTF mean | gap p99 | underrun mean | smooth |")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for r in runs:
        lines.append(
            f"| {r['concurrency']} | {r['num_requests']} | {r['num_failed']} | {_f(r['wall_s'], '.2f')} "
            f"| {_f(r['audio_s_per_s'], '.2f')} | {_f(r['requests_per_s'], '.2f')} "
            f"| {_f(r['ttfa_ms']['mean'], '.1f')} ms | {_f(r['ttfa_ms']['p50'], '.1f')} ms "
            f"| {_f(r['ttfa_ms']['p99'], '.1f')} ms | {_f(r['rtf']['mean'], '.3f')} "
            f"| {_f(r['chunk_gap_ms']['p99'], '.0f')} ms | {_f(r['underrun_s']['mean'], '.3f')} s "
            f"| {100 * r['share_smooth']:.0f}% |")
    later = [f"C={r['concurrency']} {r['ttfa_after_first_wave_ms']['mean']:.1f} / "
             f"{r['ttfa_after_first_wave_ms']['p50']:.1f} / {r['ttfa_after_first_wave_ms']['p99']:.1f} ms"
             for r in runs if (r.get("ttfa_after_first_wave_ms") or {}).get("mean") is not None]
    if later:
        lines.append("TTFA mean / p50 / p99 after the first wave (each client's later requests): "
                     + ", ".join(later))
    loads = [f"C={r['concurrency']} {r['full_load']['audio_s_per_s']:.2f} over "
             f"{r['full_load']['window_s'][0]:.2f}-{r['full_load']['window_s'][1]:.2f} s "
             f"(mean in flight {r['mean_in_flight']:.1f})"
             for r in runs if r.get("full_load")]
    if loads:
        lines.append("audio-s/s at full load (every client with a request in flight; the pass's "
                     "tail left out): " + ", ".join(loads))
    stalls = [_stalls(r) for r in runs if (r.get("stalls") or {}).get("streams")]
    if stalls:
        lines.append("streams with a gap over 100 ms (when in the pass the longest one ended; after how "
                     "much audio): " + "; ".join(stalls))
    refs = [f"C={r['concurrency']} {r['ref_cache_hits']} of {r['ref_cache_lookups']}"
            for r in runs if r.get("ref_cache_lookups")]
    if refs:
        lines.append("reference clips the server had already encoded (cache hits): " + ", ".join(refs))
    cpu = [_client_cpu(r) for r in runs if r.get("client_cpu_s") is not None and r["wall_s"] > 0]
    if cpu:
        lines.append("client CPU over the pass, busiest client process's % of one core "
                     "(near 100% = the client is the limit): " + ", ".join(cpu))
    return "\n".join(lines)


def _stalls(run: dict) -> str:
    s = run["stalls"]
    at = ", ".join(f"{v:.1f} s ({n})" for v, n in s["at_s"])
    after = ", ".join(f"{v:.2f} s ({n})" for v, n in s["after_audio_s"])
    return f"C={run['concurrency']} {s['streams']}, {s['first_wave']} of the first wave: at {at}; after {after}"


def _client_cpu(run: dict) -> str:
    procs = run.get("client_procs", 1)
    busiest = run.get("client_cpu_max_s")
    busiest = run["client_cpu_s"] if busiest is None else busiest
    text = f"C={run['concurrency']} {100 * busiest / run['wall_s']:.0f}%"
    if procs > 1:
        text += f" ({procs} processes, {100 * run['client_cpu_s'] / run['wall_s']:.0f}% in all)"
    return text


def write_json(path: str | Path, document: dict) -> None:
    Path(path).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


class ProgressLine:
    """A one-line progress bar on a stream (stderr), redrawn at most 10 times a second."""

    def __init__(self, label: str, total: int, stream: TextIO | None = sys.stderr) -> None:
        self.label, self.total, self.stream = label, total, stream
        self.done = self.failed = 0
        self._drawn = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if self.stream is not None and (self.done == self.total or time.monotonic() - self._drawn > 0.1):
            self._drawn = time.monotonic()
            width = 30
            filled = width * self.done // max(1, self.total)
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                              f"{self.done}/{self.total} failed {self.failed}")
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()
