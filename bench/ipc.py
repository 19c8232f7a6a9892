"""ipc benchmark: ring and channel against multiprocessing.Queue and Pipe, in one run.

    python -m bench.ipc [--quick] [--json PATH]      (also: mossvox bench ipc)

Throughput: a spawned writer sends N records of 64 B, 4 KiB, 64 KiB and 1 MiB to the reader
(this process) as fast as it can; the clock runs from the start signal to the last record read.
The ring writer copies bytes in with ``Ring.send`` and the reader takes a zero-copy view and
releases it; the channel sends an int message plus a numpy payload and the reader views it with
``Received.array``; Queue and Pipe (``send_bytes``/``recv_bytes``) hand the reader a bytes copy,
as they must.

Wake-up latency: the writer sleeps 2 ms (so the reader is asleep on its doorbell, pipe or queue),
then sends ``time.monotonic_ns()``; the reader subtracts it from its own clock on receipt
(CLOCK_MONOTONIC is system-wide). p50/p99 over all samples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import struct
import time

import numpy as np
import uvloop

from ipc.channel import Channel
from ipc.ring import Ring, record_footprint
from ipc.shm import new_instance_id

SIZES = (64, 4096, 65536, 1 << 20)
TRANSPORTS = ("ring", "channel", "queue", "pipe")
LATENCY_TRANSPORTS = ("ring", "channel", "channel-async", "queue", "pipe")  # async: uvloop
LATENCY_GAP_S = 0.002
_TS = struct.Struct("<q")
_SPAWN = mp.get_context("spawn")


def _records(size: int, quick: bool) -> int:
    """How many records per cell: about 256 MiB (64 MiB quick) or 200k (50k quick) records."""
    by_bytes = (64 << 20 if quick else 256 << 20) // size
    return max(200, min(50_000 if quick else 200_000, by_bytes))


def _capacity(size: int) -> int:
    return max(1 << 20, 4 * record_footprint(size + 64))


# -- writer processes -----------------------------------------------------------------------
def _throughput_writer(transport: str, handle, size: int, n: int, ready, go) -> None:
    end = handle.open() if transport in ("ring", "channel") else handle
    data = b"\xab" * size
    array = np.frombuffer(data, np.uint8)
    ready.set()
    go.wait()
    if transport == "ring":
        for _ in range(n):
            end.send(data, 60)
    elif transport == "channel":
        for i in range(n):
            end.send(i, array, timeout=60)
    elif transport == "queue":
        for _ in range(n):
            end.put(data)
    else:
        for _ in range(n):
            end.send_bytes(data)
    if transport in ("ring", "channel"):
        end.close()
    elif transport == "queue":
        end.close()
        end.join_thread()


def _latency_writer(transport: str, handle, n: int, ready) -> None:
    end = handle.open() if transport.startswith(("ring", "channel")) else handle
    ready.set()
    for _ in range(n):
        time.sleep(LATENCY_GAP_S)
        now = time.monotonic_ns()
        if transport == "ring":
            end.send(_TS.pack(now))
        elif transport.startswith("channel"):
            end.send(now)
        elif transport == "queue":
            end.put(now)
        else:
            end.send_bytes(_TS.pack(now))
    if transport == "queue":
        end.close()
        end.join_thread()
    elif transport != "pipe":
        end.close()


# -- reader side (this process) ---------------------------------------------------------------
def _make(transport: str, size: int, instance: str, tag: str):
    """(reader end, handle for the writer process)."""
    if transport == "ring":
        ring = Ring.create(f"bench-{tag}", _capacity(size), role="reader", instance=instance)
        return ring, ring.spec()
    if transport.startswith("channel"):
        chan = Channel.create(f"bench-{tag}", msg_type=int, capacity=_capacity(size),
                              role="reader", instance=instance)
        return chan, chan.spec()
    if transport == "queue":
        q = _SPAWN.Queue()
        return q, q
    reader, writer = _SPAWN.Pipe(duplex=False)
    return reader, writer


def measure_throughput(transport: str, size: int, n: int, instance: str) -> float:
    """Records per second from ``transport``'s writer process to this one."""
    end, handle = _make(transport, size, instance, f"tp-{transport}-{size}")
    ready, go = _SPAWN.Event(), _SPAWN.Event()
    proc = _SPAWN.Process(target=_throughput_writer, args=(transport, handle, size, n, ready, go))
    proc.start()
    try:
        if not ready.wait(60):
            raise RuntimeError(f"{transport} writer did not start")
        t0 = time.perf_counter()
        go.set()
        if transport == "ring":
            for _ in range(n):
                end.recv(60)
                end.release()
        elif transport == "channel":
            for _ in range(n):
                with end.recv(60) as got:
                    got.array(np.uint8)
        elif transport == "queue":
            for _ in range(n):
                end.get(timeout=60)
        else:
            for _ in range(n):
                end.recv_bytes()
        seconds = time.perf_counter() - t0
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
        end.close()
    return n / seconds


def measure_latency(transport: str, n: int, instance: str) -> np.ndarray:
    """One-way wake-up latencies in microseconds."""
    end, handle = _make(transport, 64, instance, f"lat-{transport}")
    ready = _SPAWN.Event()
    proc = _SPAWN.Process(target=_latency_writer, args=(transport, handle, n, ready))
    proc.start()
    samples = np.empty(n, dtype=np.float64)
    try:
        if not ready.wait(60):
            raise RuntimeError(f"{transport} writer did not start")
        if transport == "channel-async":  # the API process's way: uvloop + add_reader
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(_async_latency(end, samples))
        else:
            for i in range(n):
                if transport == "ring":
                    sent = _TS.unpack(end.recv(60))[0]
                    end.release()
                elif transport == "channel":
                    sent = end.recv(60).msg
                elif transport == "queue":
                    sent = end.get(timeout=60)
                else:
                    sent = _TS.unpack(end.recv_bytes())[0]
                samples[i] = (time.monotonic_ns() - sent) / 1000.0
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
        end.close()
    return samples


async def _async_latency(chan: Channel, samples: np.ndarray) -> None:
    for i in range(len(samples)):
        sent = (await chan.recv_async()).msg
        samples[i] = (time.monotonic_ns() - sent) / 1000.0


# -- report -----------------------------------------------------------------------------------
def _fmt_rate(rate: float) -> str:
    return f"{rate / 1e6:.2f} M/s" if rate >= 1e6 else f"{rate / 1e3:.1f} k/s"


def _fmt_size(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB" if size >= 1024 \
        else f"{size} B"


def run(quick: bool) -> dict:
    """Measure everything; returns the raw figures."""
    instance = new_instance_id()
    results: dict = {"quick": quick, "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(),
                     "throughput": {}, "latency_us": {}}
    for size in SIZES:
        n = _records(size, quick)
        results["throughput"][size] = {t: measure_throughput(t, size, n, instance)
                                       for t in TRANSPORTS}
    n_lat = 300 if quick else 2000
    for transport in LATENCY_TRANSPORTS:
        lat = measure_latency(transport, n_lat, instance)
        results["latency_us"][transport] = {"p50": float(np.percentile(lat, 50)),
                                            "p99": float(np.percentile(lat, 99)), "n": n_lat}
    results["loadavg_after"] = os.getloadavg()
    return results


def report(results: dict) -> str:
    lines = [f"ipc benchmark ({'quick' if results['quick'] else 'full'}), "
             f"{results['cpus']} CPUs, load average before "
             f"{results['loadavg_before'][0]:.2f}, after {results['loadavg_after'][0]:.2f}",
             "", "throughput, writer process -> reader process (records/s, MB/s):",
             f"{'size':>8} | {'ring':>21} | {'channel':>21} | {'Queue':>21} | {'Pipe':>21} |"
             f" ring/Queue | ring/Pipe | channel/Queue"]
    for size, by in results["throughput"].items():
        cells = [f"{_fmt_rate(by[t]):>10} {by[t] * size / 1e6:>7.0f} MB/s" for t in TRANSPORTS]
        lines.append(f"{_fmt_size(size):>8} | " + " | ".join(cells) +
                     f" | {by['ring'] / by['queue']:>9.1f}x | {by['ring'] / by['pipe']:>8.1f}x |"
                     f" {by['channel'] / by['queue']:>12.1f}x")
    lat = results["latency_us"]
    lines += ["", f"one-way wake-up latency, reader asleep (us, {lat['ring']['n']} samples):",
              f"{'transport':>14} | {'p50':>8} | {'p99':>8} | Queue p50 / p50 | Pipe p50 / p50"]
    for transport, v in lat.items():
        lines.append(f"{transport:>14} | {v['p50']:>8.1f} | {v['p99']:>8.1f} | "
                     f"{lat['queue']['p50'] / v['p50']:>14.2f}x | "
                     f"{lat['pipe']['p50'] / v['p50']:>13.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "mossvox bench ipc") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer records (under 30 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the raw figures as JSON")
    args = parser.parse_args(argv)
    results = run(args.quick)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(prog="python -m bench.ipc"))
