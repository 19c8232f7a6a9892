"""`bench.codec.duration_bins`: a codec call's kernels by duration, every kernel in one bin."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from bench.codec import duration_bins  # noqa: E402


def _bins(text: str) -> dict[str, tuple[int, float]]:
    rows = {}
    for line in text.splitlines()[1:]:
        label, rest = line.split(":")
        count, ms = rest.split("kernels,")
        rows[label.strip()] = (int(count), float(ms.split("ms")[0]))
    return rows


def test_each_kernel_falls_in_one_bin_lower_edge_inclusive() -> None:
    durations = [1.0, 4.99, 5.0, 9.0, 20.0, 99.9, 100.0, 2500.0]
    text = duration_bins(durations, edges=(5.0, 20.0, 100.0))
    assert text.splitlines()[0] == "8 kernels, 2.74 ms of kernel time"
    bins = _bins(text)
    assert bins == {"0-5 us": (2, 0.01), "5-20 us": (2, 0.01), "20-100 us": (2, 0.12), ">= 100 us": (2, 2.6)}
    assert sum(n for n, _ in bins.values()) == len(durations)


def test_no_kernels_reads_as_zero_not_an_error() -> None:
    bins = _bins(duration_bins([], edges=(5.0,)))
    assert bins == {"0-5 us": (0, 0.0), ">= 5 us": (0, 0.0)}
