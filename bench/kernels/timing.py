"""Timing one GPU operation from the host: the benches that time a kernel alone share this."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], iters: int, device: torch.device, warmup: int = 2) -> float:
    """Mean ms of `fn` over `iters` calls after `warmup` calls (CUDA events on CUDA, the host's
    clock elsewhere)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def graph_us(fn: Callable[[], object], iters: int) -> float:
    """Mean us of `fn` replayed from one CUDA graph of `iters` calls, so no host launch cost is
    timed (without CUDA: `time_ms` of host-timed calls)."""
    if not torch.cuda.is_available():
        return time_ms(fn, iters, torch.device("cpu"), warmup=1) * 1e3
    fn()  # compiled and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    return time_ms(graph.replay, 5, torch.device("cuda"), warmup=0) * 1e3 / iters
