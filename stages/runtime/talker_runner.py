"""The talker-runner seam (docs/interfaces.md "Talker runner"): one implementation per variant.

The talker worker decides *when* to call the runner; the runner owns the model, the KV cache and
every request's sampling state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from speech.sampling import SamplingParams
from stages.runtime.graph_capture import CaptureProgress

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class FrameEvent:
    """What one `step()` produced for one request: a frame of codes `[n_vq]` int64, and/or the
    end of the request. A finished event may carry the last frame's codes or none. `paused`: the
    request's input ran out (opened with `open_input`): it makes no frames until `feed`."""

    rid: int
    codes: np.ndarray | None
    finished: bool = False
    reason: FinishReason | None = None
    paused: bool = False


class TalkerRunner(Protocol):
    """What the talker worker (and direct synthesis) call on a family's runner."""

    n_vq: int  # codebooks per frame
    frame_rate: float  # frames per second (12.5)
    max_running: int  # requests it holds at most

    def can_admit(self, prompt_len: int) -> bool:
        """Whether a request with a prompt of `prompt_len` rows fits now (slots and KV blocks)."""

    def add(self, rid: int, prompt: np.ndarray, params: SamplingParams) -> None:
        """Queue a request; prompt [S, 1 + n_vq] int64 (text channel + audio channels)."""

    def step(self) -> list[FrameEvent]:
        """One scheduler step: (chunked) prefill of added requests next to one decode frame of
        every running request; at most one event per request."""

    def remove(self, rid: int) -> None:
        """Abort or forget a request: frees its KV blocks and state (no-op if unknown)."""

    # Only the runners of variants that take text while they speak (`Variant.open_text_stream`,
    # Realtime) have these two:
    #   open_input(rid): more input comes later; the request pauses (a `paused` event) when its
    #     input runs out, until `feed`.
    #   feed(rid, rows, *, final, forced_frames=None): rows `[n, 1 + n_vq]` of the kind its
    #     prompt ends with, appended; `final`: no more come (`forced_frames` replaces the forced
    #     length). Unknown rids are ignored.

    def num_running(self) -> int:
        """Requests held (prefilling or decoding)."""

    def max_prompt_rows(self) -> int:
        """The longest prompt (rows) it can ever take; 0 = no limit. The API refuses longer ones."""

    def capture_ahead(self, budget_s: float, progress: CaptureProgress | None = None) -> int:
        """Record, at warm-up and within `budget_s`, the graphs serving may need that requests
        have not made yet (so none is captured while requests wait); returns how many (0: none).
        Each graph made is counted in `progress`; while it plans, none is made
        (`graph_capture.make_missing`)."""

    def capture_decode_graphs(self, budget_s: float, progress: CaptureProgress | None = None) -> int:
        """Record, at warm-up and within `budget_s`, the decode graphs of every batch bucket when
        they are few (one block-table width), for what the warm-up met; returns how many (0: none),
        each counted in `progress` as `capture_ahead` does."""

    def close(self) -> None:
        """Release what the runner holds besides memory (a tensor-parallel runner stops its follower
        ranks); called once, when the worker stops."""
