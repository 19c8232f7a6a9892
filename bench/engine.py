"""Offline engine benchmark: audio-s/s and time to first chunk, engine vs. the models directly.

    python -m bench.engine [--profile cpu] [--set k=v ...] [--model DIR]
                           [--concurrency 1,4,16] [--frames 40] [--requests-per-client 2]
    (also: mossvox bench engine)

In one run, on the same machine and the same checkpoint (default: the tiny random-weight demo
model, lengths forced to `--frames` frames of 80 ms):

1. baseline: the requests run one after another through the models directly, in this process,
   without workers or rings (`stages.synth_direct`);
2. the engine (talker and codec processes, coordinator, rings) at each client concurrency C,
   closed loop: C tasks each submit their next request as soon as the previous one ended, after
   a warm-up that wraps the PCM ring once (first-touch page faults are start-up cost).

Printed per row: audio-s/s, requests/s, time to first chunk (mean, p50, p95) and the ratio of
audio-s/s against the baseline. Engine overhead per PCM chunk: time in coordinator handlers, in
the codec writing PCM/ChunkDone records, and in the client taking records off its rings, summed
and divided by the chunks delivered (µs/chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.levels import add_concurrency_option, levels_of


@dataclass
class Row:
    """One measured configuration."""

    name: str
    concurrency: int
    requests: int
    audio_s: float
    wall_s: float
    ttfc_mean_ms: float
    ttfc_p50_ms: float
    ttfc_p95_ms: float

    @property
    def audio_s_per_s(self) -> float:
        return self.audio_s / self.wall_s

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s


def _row(name: str, concurrency: int, audio_s: float, wall_s: float, ttfc: list[float]) -> Row:
    ms = sorted(t * 1000 for t in ttfc)
    return Row(name, concurrency, len(ttfc), audio_s, wall_s, statistics.fmean(ms),
               ms[len(ms) // 2], ms[min(len(ms) - 1, int(0.95 * len(ms)))])


def _texts(n: int) -> list[str]:
    return [f"Benchmark sentence number {i}, spoken at an even pace." for i in range(n)]


def run_direct(model_dir: Path, profile, n: int, frames: int) -> Row:
    """The baseline: `n` requests one after another through the runners, no processes."""
    import torch

    from stages.synth_direct import DirectSynthesizer

    if profile.talker.torch_threads:
        torch.set_num_threads(profile.talker.torch_threads)
    synth = DirectSynthesizer(model_dir, profile)
    synth.synthesize("warm up", seed=0, forced_frames=2)
    ttfc, audio = [], 0.0
    start = time.perf_counter()
    for i, text in enumerate(_texts(n)):
        pcm, stats = synth.synthesize(text, seed=i, forced_frames=frames)
        ttfc.append(stats.first_chunk_s)
        audio += pcm.shape[1] / synth.sample_rate
    return _row("direct (sequential)", 1, audio, time.perf_counter() - start, ttfc)


async def run_engine(handle, concurrency: int, n: int, frames: int) -> Row:
    """`n` requests through the engine by `concurrency` closed-loop clients."""
    from speech.job import SpeechJob

    client = handle.client(0)
    texts = _texts(n)
    todo = iter(range(n))
    ttfc: list[float] = []
    audio = [0.0]

    async def worker() -> None:
        for i in todo:
            t0 = time.perf_counter()
            first = None
            async for chunk in client.generate(SpeechJob(text=texts[i], forced_frames=frames,
                                                         sampling={"seed": i})):
                if first is None and len(chunk.pcm):
                    first = time.perf_counter() - t0
                audio[0] += len(chunk.pcm) / client.sample_rate
            ttfc.append(first or 0.0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return _row(f"engine C={concurrency}", concurrency, audio[0], time.perf_counter() - start,
                ttfc)


async def warm_up(handle) -> None:
    """Push enough audio through the engine to wrap the PCM ring once: the first touch of each
    shared-memory page costs a page fault, which is start-up cost, not steady-state overhead."""
    v = handle.variant
    frame_bytes = v.samples_per_frame * v.channels * 4
    frames = handle.profile.ipc.pcm_ring_bytes // frame_bytes + 1
    await run_engine(handle, 4, 4, max(2, -(-frames // 4)))


def overhead_us_per_chunk(before: dict, after: dict) -> dict:
    """Coordinator, codec-emit and client-receive time per PCM chunk between two snapshots."""
    chunks = max(1.0, after["chunks"] - before["chunks"])
    parts = {k: (after[k] - before[k]) * 1e6 / chunks
             for k in ("coordinator_busy_s", "codec_emit_s", "client_route_s")}
    parts["total"] = sum(parts.values())
    parts["chunks"] = int(chunks)
    return parts


async def bench(profile, model_dir: Path, levels: list[int], per_client: int, frames: int,
                baseline_requests: int) -> dict:
    from engine.launcher import launch

    direct = run_direct(model_dir, profile, baseline_requests, frames)
    rows: list[Row] = [direct]
    overheads = {}
    handle = await launch(profile, model_dir, clients=1)
    try:
        client = handle.client(0)
        await warm_up(handle)
        for c in levels:
            before = client.counters()
            rows.append(await run_engine(handle, c, c * per_client, frames))
            overheads[c] = overhead_us_per_chunk(before, client.counters())
        batches = client.counters()["decode_batch_sizes"]
    finally:
        await handle.stop()
    return {"rows": rows, "overheads": overheads, "baseline": direct, "decode_batches": batches,
            "machine": machine_info(profile, model_dir)}


def machine_info(profile, model_dir: Path) -> str:
    """One line: where and with what this ran (the figures only compare within one run)."""
    import platform

    import torch

    from stages.workers.placement import resolve_device

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{platform.machine()} {os.cpu_count()} cores{gpu}, load {load:.2f}; torch "
            f"{torch.__version__}, python {platform.python_version()}; device "
            f"{resolve_device(profile.model.device)}, talker/codec torch threads "
            f"{profile.talker.torch_threads}/{profile.codec.torch_threads}; model {model_dir.name}")


def print_report(result: dict, frames: int) -> None:
    base = result["baseline"].audio_s_per_s
    print(f"\n{result['machine']}")
    print(f"requests of {frames} frames ({frames * 0.08:.2f} s of audio each)")
    print(f"{'run':22} {'req':>4} {'audio-s/s':>10} {'req/s':>7} {'TTFC mean':>10} "
          f"{'p50':>8} {'p95':>8} {'x direct':>9}")
    for r in result["rows"]:
        print(f"{r.name:22} {r.requests:4d} {r.audio_s_per_s:10.2f} {r.requests_per_s:7.2f} "
              f"{r.ttfc_mean_ms:8.1f}ms {r.ttfc_p50_ms:6.1f}ms {r.ttfc_p95_ms:6.1f}ms "
              f"{r.audio_s_per_s / base:8.2f}x")
    print("\nengine overhead per PCM chunk (µs): coordinator + codec ring writes + client reads")
    for c, o in result["overheads"].items():
        print(f"  C={c:<3d} {o['total']:8.1f}  (coordinator {o['coordinator_busy_s']:.1f}, "
              f"codec emit {o['codec_emit_s']:.1f}, client {o['client_route_s']:.1f}; "
              f"{o['chunks']} chunks)")
    print(f"decode batch sizes (size: dispatches): {result['decode_batches']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mossvox bench engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint directory (default: profile model.path, else demo model)")
    add_concurrency_option(parser, [1, 4, 16], "closed-loop clients")
    parser.add_argument("--frames", type=int, default=40, help="forced frames per request")
    parser.add_argument("--requests-per-client", type=int, default=2,
                        help="requests per concurrent client at each level")
    parser.add_argument("--baseline-requests", type=int, default=6,
                        help="requests run one after another directly (the baseline)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    if not any(a.dest == "profile" for a in parser._actions):
        from profiles.arguments import add_profile_options

        add_profile_options(parser)


def run(args: argparse.Namespace) -> int:
    import logging

    from profiles import load_profile
    from stages.tools.demo_model import resolve_checkpoint

    logging.basicConfig(level=logging.WARNING)
    model_dir, profile = resolve_checkpoint(load_profile(args.profile or "cpu", args.overrides), args.model)
    levels = levels_of(args)
    result = asyncio.run(bench(profile, model_dir, levels, args.requests_per_client, args.frames,
                               args.baseline_requests))
    print_report(result, args.frames)
    if args.json is not None:
        out = {"machine": result["machine"],
               "rows": [asdict(r) | {"audio_s_per_s": r.audio_s_per_s} for r in result["rows"]],
               "overhead_us_per_chunk": result["overheads"],
               "decode_batch_sizes": result["decode_batches"]}
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
