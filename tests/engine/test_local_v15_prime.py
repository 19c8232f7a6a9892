"""`codec.prime_continuation`: a continuation request (reference codes + transcript) primes the
codec with the reference codes unless the profile turns the prime off; other requests never do."""

import numpy as np

from profiles import load_profile
from stages.registry import load_variant
from tests.conftest import speech_job


def test_prime_follows_the_profile(demo_model_dir) -> None:
    codes = np.arange(7 * 12, dtype=np.int64).reshape(7, 12) % 1024
    on = load_variant(demo_model_dir, load_profile("cpu"))
    off = load_variant(demo_model_dir, load_profile("cpu", overrides=["codec.prime_continuation=false"]))
    continuation = on.build_request(speech_job("Hello there.", ref_codes=codes, ref_text="the reference"))
    assert continuation.prime_frames == 7 and (continuation.prime_codes == codes).all()
    assert (continuation.prompt[-7:, 1:] == codes).all()  # the prompt ends with the same rows
    assert on.build_request(speech_job("Hello there.", ref_codes=codes)).prime_codes is None  # voice clone
    assert off.build_request(speech_job("Hello there.", ref_codes=codes, ref_text="the reference")).prime_codes is None


def test_context_continues_the_audio_just_spoken_with_the_same_reference(demo_model_dir) -> None:
    variant = load_variant(demo_model_dir, load_profile("cpu"))
    ref = np.arange(5 * 12, dtype=np.int64).reshape(5, 12) % 1024
    spoken = np.arange(9 * 12, dtype=np.int64).reshape(9, 12) % 1000
    request = variant.build_request(speech_job("The next sentence.", ref_codes=ref, context_codes=spoken,
                                               context_text="The sentence before. "))
    assert request.prime_frames == 9 and (request.prime_codes == spoken).all()
    clone = variant.build_request(speech_job("The sentence before. The next sentence.", ref_codes=ref))
    assert (request.prompt[: len(clone.prompt)] == clone.prompt).all()  # the same voice reference
    # the length is forced from this sentence's text only (cpu profile), not the context's
    assert request.sampling.forced_frames == round(0.87 * len("The next sentence."))
