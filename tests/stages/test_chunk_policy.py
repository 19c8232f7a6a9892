"""Chunk policy: sizes follow initial → ramp → steady, the tail is a partial chunk or empty terminal."""

import numpy as np
import pytest

from stages.runtime.chunk_policy import ChunkAccumulator, ChunkSchedule

N_VQ = 3


def run(schedule: ChunkSchedule, n_frames: int) -> list[np.ndarray]:
    acc = ChunkAccumulator(schedule, N_VQ)
    chunks = []
    for i in range(n_frames):
        chunk = acc.push(np.full(N_VQ, i, dtype=np.int64))
        if chunk is not None:
            chunks.append(chunk)
    chunks.append(acc.finish())
    return chunks


def test_sizes_initial_ramp_steady_partial() -> None:
    chunks = run(ChunkSchedule(1, (4, 8), 15), 1 + 4 + 8 + 15 + 15 + 7)
    assert [len(c) for c in chunks] == [1, 4, 8, 15, 15, 7]


def test_exact_multiple_ends_with_empty_terminal() -> None:
    chunks = run(ChunkSchedule(1, (), 15), 31)
    assert [len(c) for c in chunks] == [1, 15, 15, 0]
    assert chunks[-1].shape == (0, N_VQ) and chunks[-1].dtype == np.int64


def test_frames_keep_order_and_content() -> None:
    chunks = run(ChunkSchedule(2, (3,), 4), 20)
    flat = np.concatenate(chunks)
    assert flat.shape == (20, N_VQ)
    assert (flat[:, 0] == np.arange(20)).all()


def test_per_request_initial_override() -> None:
    base = ChunkSchedule(1, (), 15)
    assert base.with_initial(None) is base
    chunks = run(base.with_initial(5), 12)
    assert [len(c) for c in chunks] == [5, 7]


def test_no_frames_gives_only_terminal() -> None:
    assert [len(c) for c in run(ChunkSchedule(), 0)] == [0]


def test_rejects_zero_sizes() -> None:
    with pytest.raises(ValueError, match="ramp"):
        ChunkSchedule(1, (0,), 15)
