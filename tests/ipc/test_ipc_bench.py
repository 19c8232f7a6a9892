"""The benchmark's measuring code runs end to end on a tiny load (figures are not asserted: the
machine is shared; docs/performance.md holds a real run)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.ipc import LATENCY_TRANSPORTS, TRANSPORTS, measure_latency, measure_throughput, report

pytestmark = pytest.mark.timeout(60)  # a lost wake-up must fail fast, not hang


def test_bench_measures_every_transport(instance):
    throughput = {t: measure_throughput(t, 4096, 300, instance) for t in TRANSPORTS}
    assert all(rate > 0 for rate in throughput.values())
    latency = {t: measure_latency(t, 5, instance) for t in LATENCY_TRANSPORTS}
    for samples in latency.values():
        assert samples.shape == (5,) and np.all(samples > 0) and np.all(samples < 1e6)
    text = report({"quick": True, "cpus": 2, "loadavg_before": (0, 0, 0),
                   "loadavg_after": (0, 0, 0), "throughput": {4096: throughput},
                   "latency_us": {t: {"p50": float(np.median(v)), "p99": float(v.max()), "n": 5}
                                  for t, v in latency.items()}})
    assert "4 KiB" in text and "ring/Queue" in text and "channel-async" in text
