"""`codec.prime_continuation`: a continuation request (reference codes + transcript) primes the
codec with the reference codes unless the profile turns the prime off; other requests never do."""

from dataclasses import dataclass

import numpy as np

from profiles import load_profile
from stages.registry import load_variant


@dataclass
class Job:
    text: str = "Hello there."
    ref_codes: np.ndarray | None = None
    ref_text: str | None = None


def test_prime_follows_the_profile(demo_model_dir) -> None:
    codes = np.zeros((7, 12), dtype=np.int64)
    on = load_variant(demo_model_dir, load_profile("cpu"))
    off = load_variant(demo_model_dir, load_profile("cpu", overrides=["codec.prime_continuation=false"]))
    assert on.prime_frames(Job(ref_codes=codes, ref_text="the reference")) == 7
    assert on.prime_frames(Job(ref_codes=codes)) == 0  # voice clone: no left context
    assert off.prime_frames(Job(ref_codes=codes, ref_text="the reference")) == 0
