"""`SpeechJob`: one speech request as a caller states it, before any model has seen it.

The API builds it from the HTTP body (or a caller builds it); the variant's request adapter reads
it (`stages.variant.Variant.build_request`) and the engine carries the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpeechJob:
    """A speech request: text, optional references, sampling overrides, chunking and length."""

    text: str
    language: str | None = None
    instructions: str | None = None
    ref_codes: np.ndarray | None = None   # [T, n_vq] int64, from the reference-code cache
    ref_text: str | None = None            # continuation mode when set with ref_codes
    extra_ref_codes: list = field(default_factory=list)  # further references [T, n_vq] int64
    #   each, after ref_codes (TTSD: speakers S2, S3, ...)
    sampling: dict = field(default_factory=dict)  # temperature, top_p, top_k,
    #   repetition_penalty, seed, max_new_frames, greedy
    initial_chunk_frames: int | None = None
    forced_frames: int | None = None       # benchmark / random-weights forced length
    context_codes: np.ndarray | None = None  # [T, n_vq] int64: audio spoken just before this
    #   text (the previous sentence of a stream), for variants that continue it; others ignore it
    context_text: str | None = None        # the transcript of context_codes
