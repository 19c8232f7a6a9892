"""Resolving a request's sampling settings: variant defaults + the job's overrides + forced length.

Every variant resolves its requests' sampling here (`Variant.resolve_sampling`; docs/interfaces.md):
only `OVERRIDABLE` keys, each converted to its `SamplingParams` type (`ValueError` naming the
key), `max_new_frames` capped by `model.max_new_frames`, a random seed when none is given, and the
forced length (`job.forced_frames`, else the profile's `force_length_from_text`, logged once).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import msgspec

from profiles import Profile
from speech.job import SpeechJob
from speech.sampling import SamplingParams

log = logging.getLogger(__name__)

# Keys a request may override in `SpeechJob.sampling` (the HTTP body's sampling fields).
OVERRIDABLE = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_new_frames",
               "greedy")
_FIELD_TYPES = {f.name: f.type for f in msgspec.structs.fields(SamplingParams)}


def _checked(key: str, value: Any) -> Any:
    """`value` converted to the type of `SamplingParams` field `key`; ValueError naming the key."""
    try:
        return msgspec.convert(value, _FIELD_TYPES[key])
    except msgspec.ValidationError as e:
        raise ValueError(f"sampling field {key!r}: {e}") from None


class SamplingResolver:
    """One variant's defaults under one profile; `resolve(job)` per request (API process)."""

    def __init__(self, defaults: SamplingParams, profile: Profile) -> None:
        cap = profile.model.max_new_frames
        self.defaults = msgspec.structs.replace(defaults, max_new_frames=min(defaults.max_new_frames, cap))
        self.profile = profile
        self._forced_logged = False

    def resolve(self, job: SpeechJob) -> SamplingParams:
        """The job's `SamplingParams`: defaults, overrides, seed, forced length (ValueError on a bad key)."""
        overrides = dict(job.sampling or {})
        unknown = sorted(set(overrides) - set(OVERRIDABLE))
        if unknown:
            raise ValueError(f"unknown sampling fields {unknown}; allowed: {list(OVERRIDABLE)}")
        overrides = {k: _checked(k, v) for k, v in overrides.items() if v is not None}
        cap = self.profile.model.max_new_frames
        max_new = min(int(overrides.pop("max_new_frames", self.defaults.max_new_frames)), cap)
        if max_new < 1:
            raise ValueError(f"max_new_frames must be >= 1, got {max_new}")
        seed = int(overrides.pop("seed", secrets.randbelow(2**31)))
        return msgspec.structs.replace(self.defaults, **overrides, seed=seed, max_new_frames=max_new,
                                       forced_frames=self._forced_frames(job, max_new))

    def _forced_frames(self, job: SpeechJob, max_new: int) -> int | None:
        if job.forced_frames is not None:  # explicit: not capped, so the frame cap still ends
            return max(1, int(job.forced_frames))  # it, with finish_reason "length"
        model = self.profile.model
        if not model.force_length_from_text:
            return None
        if not self._forced_logged:
            log.info("model.force_length_from_text is on: each request's length is forced to "
                     "%.2f frames per character (random weights stop at random)",
                     model.frames_per_char)
            self._forced_logged = True
        return max(1, min(round(model.frames_per_char * len(job.text or "")), max_new))
