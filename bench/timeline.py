"""Where a serving pass spent its time, from the workers' timelines (`stages.workers.timeline`).

    python -m bench.timeline DIR [--gap 0.5] [--window START END] [--json out.json] [--first-wave N]
                                 [--events out.jsonl [--events-s 1.0]]

Splits the events into passes (activity separated by at least `--gap` seconds with no talker step
and no codec dispatch, e.g. a benchmark's warm-up pass and its measured pass) and prints, per pass (with `--window`, only the events between two
`time.monotonic()` readings, as one pass):
- the talker: steps, busy share of the pass, rows per step, step time with and without prefill,
  and where the runner timed its steps on the GPU, their spans there and the GPU's idle time
  between them (the talker's stream waiting for the host), the spans of steps with and without
  prompt tokens and a fit of a step's span to its decode rows and prompt tokens (one step ahead,
  a call's host time holds the wait for the step before: only the GPU spans split the two),
  the host time around each step (inbox drain, admission, emitting chunks: its median is the
  busy figure, its mean also counts the idle waits of the drain), prompt tokens prefilled and
  taken from the prefix cache;
- the codec: dispatches, busy share, chunks per dispatch, distinct chunk lengths per dispatch,
  decode time per dispatch and per decoded frame, time between dispatch starts;
- the codec's reference encodes: batches, clips per batch, time per batch and per clip, the
  share of the pass with a batch in flight, a clip's wait in the codec loop's queue and how many
  stay queued when a batch is handed over; with the engine clients' timelines, an encode job's
  round trip from the API process (its send to its codes back);
- the two together: share of the pass with both busy, with only one, with neither;
- a request's life: admission → first frame (prefill), first frame → last frame (decode), last
  frame → its final chunk decoded (codec tail), first frame → first chunk decoded (first audio's
  codec share), and each chunk's wait from arrival at the codec to its dispatch, by chunk index;
  with the engine clients' timelines (each API process's `client<N>` file): a request's submit
  → its admission by the talker (the coordinator and the talker's inbox), and its first and final
  chunks decoded → their PCM taken off the client's ring (the codec's ring writes for its whole
  dispatch, then the client's reader); when the API gave its arrival, the request received by
  the API process → submitted, and its parts where the API gave them: received → parsed (the
  body read and validated), parsed → voice (the reference codes resolved; with a reference clip
  in parts: parsed → loaded, its bytes fetched and decoded, and loaded → voice, the samples
  prepared and encoded or found cached), voice → submit (the
  prompt built and sent); the first chunk on the client's ring → taken
  by its request (the process's loop) → handled (encoded and handed to the HTTP server).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from stages.workers.timeline import read_events

SPANS = ("talker_step", "codec_dispatch", "codec_encode")


def _end(e: dict[str, Any]) -> float:
    return e["t"] + e.get("dur", 0.0) + e.get("emit", 0.0)


def split_passes(events: list[dict[str, Any]], gap: float) -> list[list[dict[str, Any]]]:
    """Runs of events whose spans (steps, dispatches) are separated by less than `gap` seconds."""
    passes: list[list[dict[str, Any]]] = []
    last_end = None
    for e in events:
        if e["k"] in SPANS:
            if (not passes) if last_end is None else e["t"] - last_end >= gap:
                passes.append([])  # (events before the first span already opened the first pass)
            last_end = max(last_end or 0.0, _end(e))
        if passes:
            passes[-1].append(e)
        elif e["k"] not in SPANS:  # request events before the first span join the first pass
            passes.append([e])
    return [p for p in passes if any(e["k"] in SPANS for e in p)]


def _busy(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals, sorted and merged."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(values), "mean": statistics.fmean(values), "p50": ordered[len(ordered) // 2],
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "max": ordered[-1]}


def summarize(events: list[dict[str, Any]], first_wave: int = 0) -> dict[str, Any]:
    """The figures of one pass (see the module docstring). With `first_wave` N, the request
    figures also for the pass's first N requests (by submit, else admission: a closed-loop
    benchmark's opening burst at concurrency N) and for the others."""
    steps = [e for e in events if e["k"] == "talker_step"]
    disp = [e for e in events if e["k"] == "codec_dispatch"]
    spans = [e for e in events if e["k"] in SPANS]
    t0 = min(e["t"] for e in spans)
    t1 = max(_end(e) for e in spans)
    window = max(t1 - t0, 1e-9)
    out: dict[str, Any] = {"window_s": window}

    talker_busy = _busy([(e["t"], e["t"] + e["dur"]) for e in steps])
    codec_busy = _busy([(e["t"], e["t"] + e["dur"]) for e in disp]
                       + [(e["t"], e["t"] + e["dur"]) for e in events if e["k"] == "codec_encode"])
    both = _intersect(talker_busy, codec_busy)
    tb, cb = _length(talker_busy), _length(codec_busy)
    out["gpu"] = {"talker_busy": tb / window, "codec_busy": cb / window, "both": both / window,
                  "talker_only": (tb - both) / window, "codec_only": (cb - both) / window,
                  "neither": 1 - (tb + cb - both) / window}
    if steps:
        prefill = [e for e in steps if e.get("prefill")]
        decode_only = [e for e in steps if not e.get("prefill")]
        out["talker"] = {
            "steps": len(steps),
            "rows_per_step": statistics.fmean(e["frames"] for e in steps),
            "running_per_step": statistics.fmean(e["batch"] for e in steps),
            "step_ms": _scale(_stats([e["dur"] for e in steps]), 1e3),
            "decode_only_step_ms": _scale(_stats([e["dur"] for e in decode_only]), 1e3),
            "prefill_step_ms": _scale(_stats([e["dur"] for e in prefill]), 1e3),
            "prefill_steps": len(prefill),
            "prefill_tokens_per_prefill_step": statistics.fmean(e["prefill"] for e in prefill) if prefill else 0,
            "prefill_tokens": sum(e["prefill"] for e in prefill),
            "cached_prompt_tokens": sum(e.get("cached", 0) for e in steps),  # from the prefix cache
            # the drain includes the wait for work when the talker idles (one step after a pause
            # can carry seconds of it): the median says what a busy step's host work is
            "host_ms_per_step": _scale(_stats([e["emit"] + e["drain"] + e["admit"] for e in steps]), 1e3),
            "emit_ms_per_step": statistics.fmean(e["emit"] for e in steps) * 1e3,
            "frames": sum(e["frames"] for e in steps),
            # a graph recorded or a kernel compiled while serving stalls every stream for it
            "graphs_recorded": sum(e.get("graphs", 0) for e in steps),
            "compiles": sum(e.get("compiles", 0) for e in steps),
            "triton_kernels": sum(e.get("kernels", 0) for e in steps),  # specialised on first use
            "steps_over_100ms": sum(e["dur"] > 0.1 for e in steps),
            "gc_ms": sum(e.get("gc", 0.0) for e in steps) * 1e3,  # garbage collection inside steps
            # steps in which the CUDA caching allocator had to ask the device for memory, and the
            # longest of them: whether a new allocation is what a stalled step did
            "allocating_steps": sum(e.get("allocs", 0) > 0 for e in steps),
            "allocating_step_max_ms": max((e["dur"] for e in steps if e.get("allocs", 0) > 0),
                                          default=0.0) * 1e3,
        }
        # the steps as the GPU timed them (CUDA events, `stages.runtime.step_clock`), read back
        # in an iteration: [span s, decode rows, prompt tokens] each
        timed = [e for e in steps if e.get("gpu_steps")]
        if timed:
            span = [sum(s[0] for s in e["gpu_steps"]) for e in timed]
            out["talker"] |= {
                "gpu_step_ms": _scale(_stats([d / len(e["gpu_steps"]) for d, e in zip(span, timed)]), 1e3),
                # the talker's stream idle between a step's end and the next one's start, the
                # pass's first step (its wait for the first requests) left out
                "gpu_idle_ms_per_step": _scale(_stats([e["gpu_idle"] / len(e["gpu_steps"]) for e in timed[1:]]), 1e3),
                "gpu_busy": sum(span) / window,
                "gpu_idle_share": sum(e["gpu_idle"] for e in timed[1:]) / window,
            }
            out["talker"] |= _gpu_split([s for e in timed for s in e["gpu_steps"]])
    if disp:
        lengths = defaultdict(int)
        for e in disp:
            for c in e["chunks"]:
                lengths[c[2]] += 1
        frames = sum(c[2] for e in disp for c in e["chunks"])
        computed = sum(r * t for e in disp for r, t in e.get("calls", ()))  # the calls' row-frames
        starts = [e["t"] for e in disp]
        out["codec"] = {
            "dispatches": len(disp),
            "chunks_per_dispatch": statistics.fmean(e["n"] for e in disp),
            "distinct_lengths_per_dispatch": statistics.fmean(len({c[2] for c in e["chunks"]}) for e in disp),
            # the model calls (graph replays) each dispatch made, and their rows (older timelines: none)
            "calls_per_dispatch": statistics.fmean(len(e.get("calls", ())) for e in disp),
            "rows_per_call": statistics.fmean(r for e in disp for r, _ in e.get("calls", ()))
            if any(e.get("calls") for e in disp) else 0.0,
            # of the row-frames the calls decoded, the share that was padding (chunks padded to
            # their call's length; a batch bucket's extra rows not counted): what cutting chunks
            # into shorter calls (`codec.split_chunks`) removes
            "padding_share": 1 - frames / computed if computed else 0.0,
            "decode_ms": _scale(_stats([e["dur"] for e in disp]), 1e3),
            "emit_ms_mean": statistics.fmean(e["emit"] for e in disp) * 1e3,
            "decode_us_per_frame": sum(e["dur"] for e in disp) / max(frames, 1) * 1e6,
            "period_ms": statistics.fmean(b - a for a, b in zip(starts, starts[1:])) * 1e3 if len(disp) > 1 else 0,
            "chunks_by_frames": dict(sorted(lengths.items())),
            "frames": frames,
        }
    encodes = [e for e in events if e["k"] == "codec_encode"]
    if encodes:  # reference-encode batches (the codec's encoder thread)
        clips = sum(e.get("n", 1) for e in encodes)
        out["encode"] = {
            "batches": len(encodes),
            "clips": clips,
            "clips_per_batch": clips / len(encodes),
            "batch_ms": _scale(_stats([e["dur"] for e in encodes]), 1e3),
            "ms_per_clip": sum(e["dur"] for e in encodes) / clips * 1e3,
            "busy": _length(_busy([(e["t"], e["t"] + e["dur"]) for e in encodes])) / window,
        }
        if all("waited" in e for e in encodes):  # the codec loop's notes on each batch
            out["encode"].update({
                # a clip's wait in the codec loop's queue, from its arrival to its batch's hand-over
                "queued_ms_per_clip": sum(e["waited"] * e.get("n", 1) for e in encodes) / clips * 1e3,
                "queued_max_ms": max(e["waited_max"] for e in encodes) * 1e3,
                "left_waiting": statistics.fmean(e["left"] for e in encodes),  # jobs still queued after a hand-over
                "handed_ms": _scale(_stats([e["handed"] for e in encodes]), 1e3),  # hand-over to the thread's start
            })
    trips = [e for e in events if e["k"] == "client_encode"]
    if trips:  # an API process's encode jobs: sent to the codec worker, codes back
        out.setdefault("encode", {})["round_trip_ms"] = _scale(_stats([e["dur"] for e in trips]), 1e3)
    out["requests"] = _request_life(events)
    if first_wave:
        wave = set(_arrival_order(events)[:first_wave])
        out["requests_first_wave"] = _request_life(events, lambda rid: rid in wave)
        out["requests_later"] = _request_life(events, lambda rid: rid not in wave)
    return out


def _arrival_order(events: list[dict[str, Any]]) -> list[int]:
    """Request ids by their first submit (engine clients) or, without those, admission."""
    kind = "client_submit" if any(e["k"] == "client_submit" for e in events) else "talker_admit"
    seen: dict[int, float] = {}
    for e in events:
        if e["k"] == kind:
            seen.setdefault(e["rid"], e["t"])
    return sorted(seen, key=seen.__getitem__)


def _request_life(events: list[dict[str, Any]], keep: Callable[[int], bool] | None = None) -> dict[str, Any]:
    """A request's phases over the pass (module docstring); with `keep`, only the requests it takes."""
    if keep is not None:
        events = [e for e in events if "rid" not in e or keep(e["rid"])]
    admit, first, done = {}, {}, {}
    for e in events:
        if e["k"] == "talker_admit":
            admit[e["rid"]] = e["t"]
        elif e["k"] == "talker_first_frame":
            first[e["rid"]] = e["t"]
        elif e["k"] == "talker_done":
            done[e["rid"]] = e["t"]
    submit, client_first, client_final = {}, {}, {}  # the API processes' side (engine clients)
    received, first_taken, first_out = {}, {}, {}
    parsed, loaded, voiced = {}, {}, {}  # the API process's marks between received and submit
    for e in events:
        if e["k"] == "client_submit":
            submit[e["rid"]] = e["t"]
            for mark, into in (("received", received), ("parsed", parsed), ("loaded", loaded), ("voiced", voiced)):
                if mark in e:
                    into[e["rid"]] = e[mark]
        elif e["k"] == "client_first_taken":
            first_taken[e["rid"]] = e["t"]
        elif e["k"] == "client_first_out":
            first_out[e["rid"]] = e["t"]
        elif e["k"] == "client_pcm":
            if e["seq"] == 0:
                client_first.setdefault(e["rid"], e["t"])  # a large chunk may come in pieces
            if e["final"]:
                client_final[e["rid"]] = e["t"]
    first_chunk_end, final_end = {}, {}
    first_decoded, final_decoded = {}, {}  # the dispatch's decode done, before its ring writes
    waits = defaultdict(list)  # chunk index -> arrival-to-dispatch waits
    chunks_per_request = defaultdict(int)
    for e in events:
        if e["k"] != "codec_dispatch":
            continue
        end = e["t"] + e["dur"] + e["emit"]
        for rid, seq, frames, arrived, final, prime in e["chunks"]:
            if prime or (keep is not None and not keep(rid)):
                continue
            waits[min(seq, 5) if not final else "final"].append(e["t"] - arrived)
            chunks_per_request[rid] += 1
            if seq == 0:
                first_chunk_end[rid], first_decoded[rid] = end, e["t"] + e["dur"]
            if final:
                final_end[rid], final_decoded[rid] = end, e["t"] + e["dur"]
    life: dict[str, Any] = {"requests_done": len(done)}
    pairs = {
        "admit_to_first_frame_ms": (admit, first),
        "first_to_last_frame_ms": (first, done),
        "last_frame_to_final_chunk_ms": (done, final_end),
        "first_frame_to_first_chunk_ms": (first, first_chunk_end),
        "admit_to_final_chunk_ms": (admit, final_end),
        "received_to_submit_ms": (received, submit),
        "received_to_parsed_ms": (received, parsed),
        "parsed_to_voice_ms": (parsed, voiced),
        "parsed_to_loaded_ms": (parsed, loaded),  # reference clips fetched and decoded
        "loaded_to_voice_ms": (loaded, voiced),  # ... then prepared and encoded (or found cached)
        "voice_to_submit_ms": (voiced, submit),
        "submit_to_admit_ms": (submit, admit),
        "first_chunk_to_client_ms": (first_decoded, client_first),
        "final_chunk_to_client_ms": (final_decoded, client_final),
        "first_chunk_in_client_to_taken_ms": (client_first, first_taken),
        "first_chunk_taken_to_out_ms": (first_taken, first_out),
    }
    for name, (a, b) in pairs.items():
        life[name] = _scale(_stats([b[r] - a[r] for r in a if r in b]), 1e3)
    life["chunk_wait_ms_by_index"] = {str(k): _scale(_stats(v), 1e3) for k, v in sorted(waits.items(), key=str)}
    life["chunks_per_request"] = statistics.fmean(chunks_per_request.values()) if chunks_per_request else 0
    return life


def _gpu_split(parts: list[list[float]]) -> dict[str, Any]:
    """The GPU spans of steps with and without prompt tokens, and a least-squares fit of a step's
    span to `fixed + per_row * decode rows + per_token * prompt tokens` (what a prompt token costs
    as served, beside the codec's work on the same GPU), from [span s, decode rows, prompt tokens]
    per step; empty without parts, the fit left out unless the steps vary in both."""
    if not parts:
        return {}
    prefill = [span for span, _, tokens in parts if tokens]
    decode_only = [span for span, _, tokens in parts if not tokens]
    out: dict[str, Any] = {"gpu_prefill_step_ms": _scale(_stats(prefill), 1e3),
                           "gpu_decode_only_step_ms": _scale(_stats(decode_only), 1e3)}
    x = np.array([[1.0, rows, tokens] for _, rows, tokens in parts])  # [steps, 3]
    y = np.array([span for span, _, _ in parts]) * 1e3  # [steps] ms
    if len(parts) > 3 and np.linalg.matrix_rank(x) == 3:
        (fixed, per_row, per_token), *_ = np.linalg.lstsq(x, y, rcond=None)
        out["gpu_step_fit"] = {"fixed_ms": float(fixed), "ms_per_decode_row": float(per_row),
                               "us_per_prompt_token": float(per_token) * 1e3}
    return out


def _scale(stats: dict[str, float], factor: float) -> dict[str, float]:
    return {k: (v * factor if k != "n" else v) for k, v in stats.items()}


def _print(summary: dict[str, Any], index: int) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {fmt(x)}" for k, x in v.items()) + "}"
        return str(v)

    print(f"== pass {index}: {summary['window_s']:.2f} s")
    for section in ("gpu", "talker", "codec", "requests", "requests_first_wave", "requests_later"):
        if section not in summary:
            continue
        print(f"  [{section}]")
        for key, value in summary[section].items():
            print(f"    {key}: {fmt(value)}")


def opening(events: list[dict[str, Any]], seconds: float) -> list[dict[str, Any]]:
    """A pass's events in its first `seconds`, from its first event, in time order."""
    if not events:
        return []
    start = min(e["t"] for e in events)
    return sorted((e for e in events if e["t"] - start <= seconds), key=lambda e: e["t"])


def write_opening(passes: list[list[dict[str, Any]]], path: str, seconds: float) -> None:
    """Each pass's opening (`opening`) to `path` as JSON lines, a pass's events tagged with its
    index (`"pass"`)."""
    with open(path, "w") as f:
        for i, events in enumerate(passes):
            for e in opening(events, seconds):
                f.write(json.dumps({**e, "pass": i}) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--gap", type=float, default=0.5, help="seconds of no activity that separate passes")
    ap.add_argument("--window", type=float, nargs=2, metavar=("START", "END"),
                    help="only events between these time.monotonic() readings, as one pass")
    ap.add_argument("--json", help="write the summaries here too")
    ap.add_argument("--first-wave", type=int, default=0, metavar="N",
                    help="also the request figures of each pass's first N requests, and of the rest")
    ap.add_argument("--events", metavar="PATH",
                    help="write each pass's first --events-s seconds of events here, as JSON lines "
                         "(talker steps, codec dispatches, request marks: a first wave, event by event)")
    ap.add_argument("--events-s", type=float, default=1.0, metavar="S")
    args = ap.parse_args(argv)
    events = read_events(args.directory)
    if args.window:
        start, end = args.window
        passes = [[e for e in events if start <= e["t"] <= end]]
    else:
        passes = split_passes(events, args.gap)
    passes = [p for p in passes if any(e["k"] in SPANS for e in p)]
    if not passes:
        print(f"no talker step or codec dispatch in {args.directory}" + (" in that window" if args.window else ""))
        return 1
    summaries = [summarize(p, args.first_wave) for p in passes]
    if args.events:
        write_opening(passes, args.events, args.events_s)
    for i, s in enumerate(summaries):
        _print(s, i)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
