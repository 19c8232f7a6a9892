"""`bench.codec`'s helpers: a codec call's kernels by duration (`duration_bins`, every kernel in
one bin) and one served dispatch of a chunk mix, padded and cut into rows (`bench_dispatch`)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from bench.codec import bench_dispatch, duration_bins, parse_mix, random_codec  # noqa: E402


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


def test_a_dispatch_mix_is_timed_padded_and_cut_into_rows() -> None:
    """The tiny v2 codec on CPU (the graphs' eager logic): the same 1x3,2x2,15x2 dispatch padded
    into calls of its chunks' rows, and cut into more rows than chunks (the runner's default cost
    model, uncalibrated on CPU: padding 1- and 2-frame chunks to 15 models dearer)."""
    from stages.models.codec.config import CodecConfig, tiny_v2_config

    lengths = parse_mix("1x3,2x2,15x2")
    assert lengths == [1, 1, 1, 2, 2, 15, 15]
    model = random_codec(CodecConfig.from_json(tiny_v2_config()), "cpu", torch.float32, seed=1)
    for split in (False, True):
        ms, calls = bench_dispatch(model, lengths, 12, 1, "cpu", split)
        assert ms > 0 and calls
        rows = sum(r for r, _ in calls)
        assert rows > len(lengths) if split else rows == len(lengths)
        assert all(T in (1, 2, 4, 8, 15) for _, T in calls)
