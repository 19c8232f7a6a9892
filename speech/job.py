"""`SpeechJob`: one speech request as a caller states it, before any model has seen it.

The API builds it from the HTTP body (or a caller builds it); the variant's request adapter reads
it (`stages.variant.Variant.build_request`) and the engine carries the result.

A job's optional fields (`OPTIONAL_FIELDS`) are the ones a model family may or may not use: the
references (`ref_codes` and `extra_ref_codes`, from the HTTP `ref_audio` or a registered voice),
their transcript `ref_text`, `instructions` and `language`. Each variant declares which of them
it uses; the others are cleared before its adapter sees the job (`SpeechJob.without`), and the API
reports them as ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

OptionalField = Literal["reference", "ref_text", "instructions", "language"]
OPTIONAL_FIELDS: tuple[OptionalField, ...] = ("reference", "ref_text", "instructions", "language")


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
    received_at: float | None = None       # time.monotonic() when the API process began handling
    #   the request (engine timelines only: received to submit)
    parsed_at: float | None = None         # ... when its body was read and validated
    loaded_at: float | None = None         # ... when its reference clips were fetched and decoded
    voice_at: float | None = None          # ... when its voice's reference codes were resolved

    def given_fields(self) -> tuple[OptionalField, ...]:
        """The optional fields this job sets, in `OPTIONAL_FIELDS` order (blank text counts as unset)."""
        given = {"reference": self.ref_codes is not None or bool(self.extra_ref_codes),
                 "ref_text": _filled(self.ref_text), "instructions": _filled(self.instructions),
                 "language": _filled(self.language)}
        return tuple(name for name in OPTIONAL_FIELDS if given[name])

    def without(self, fields: Iterable[OptionalField]) -> SpeechJob:
        """This job with `fields` cleared (`reference`: every reference clip); itself when none is."""
        cleared: dict = {}
        for name in fields:
            if name == "reference":
                cleared.update(ref_codes=None, extra_ref_codes=[])
            elif name in OPTIONAL_FIELDS:
                cleared[name] = None
            else:
                raise ValueError(f"{name!r} is not an optional field; those are {OPTIONAL_FIELDS}")
        return dataclasses.replace(self, **cleared) if cleared else self


def _filled(text: str | None) -> bool:
    return text is not None and bool(text.strip())
