"""The delay pattern: codebook k of frame t sits k rows later (docs/model_facts.md, "Delay family").

Delayed layout `D` has `T + n_vq - 1` rows; `D[t + k, k] = codes[t, k]`, pad elsewhere. The whole
inverse (`de_delay`) is upstream's `apply_de_delay_pattern`. `IncrementalDeDelayer` inverts it
row by row while generation runs: frame t is complete as soon as row `t + n_vq - 1` (which holds
its last codebook) exists, so it can be decoded then instead of at the end of the utterance.
"""

from __future__ import annotations

import numpy as np


def apply_delay_pattern(codes: np.ndarray, pad_code: int) -> np.ndarray:
    """codes [T, n_vq] -> delayed [T + n_vq - 1, n_vq], pad where no code falls."""
    codes = np.asarray(codes)
    t, n_vq = codes.shape
    delayed = np.full((t + n_vq - 1, n_vq), pad_code, dtype=np.int64)  # [T + n_vq - 1, n_vq]
    for k in range(n_vq):
        delayed[k : k + t, k] = codes[:, k]
    return delayed


def de_delay(delayed: np.ndarray) -> np.ndarray:
    """delayed [R, n_vq] -> frames [R - n_vq + 1, n_vq] with `frames[t, k] = delayed[t + k, k]`."""
    delayed = np.asarray(delayed)
    r, n_vq = delayed.shape
    t = r - n_vq + 1
    if t < 0:
        raise ValueError(f"{r} delayed rows cannot hold a frame of {n_vq} codebooks")
    frames = np.empty((t, n_vq), dtype=np.int64)  # [T, n_vq]
    for k in range(n_vq):
        frames[:, k] = delayed[k : k + t, k]
    return frames


def is_pad_frame(frames: np.ndarray, pad_code: int) -> np.ndarray:
    """[T, n_vq] -> [T] bool: all codebooks are pad (upstream's segment separators)."""
    return (np.asarray(frames) == pad_code).all(axis=-1)


class IncrementalDeDelayer:
    """Feeds delayed rows one at a time; returns each frame once its last codebook has arrived.

    Keeps only the last n_vq - 1 rows (a ring of what incomplete frames still need), so memory does
    not grow with the utterance. Fed rows r = 0, 1, ..., it returns frame `r - n_vq + 1` at row r
    (none for the first n_vq - 1 rows): exactly the rows of `de_delay` over all rows fed.
    """

    def __init__(self, n_vq: int) -> None:
        self.n_vq = n_vq
        self._window = np.zeros((n_vq, n_vq), dtype=np.int64)  # ring of the last n_vq rows
        self._rows = 0

    @property
    def rows_fed(self) -> int:
        return self._rows

    def push(self, row: np.ndarray) -> np.ndarray | None:
        """row [n_vq] (audio channels of one delayed row) -> the completed frame [n_vq] or None."""
        n = self.n_vq
        self._window[self._rows % n] = row
        self._rows += 1
        t = self._rows - n  # frame completed by this row
        if t < 0:
            return None
        # frame t, codebook k lives in row t + k
        return self._window[(t + np.arange(n)) % n, np.arange(n)].copy()
