"""Reference clips made new to the server, so a pass measures voices it has never heard.

A server keeps what it has heard: the reference-code cache (by the clip's bytes) and the talker's
prefix cache (by the prompt's rows, which hold the clip's codes). A pass that sends clips the
server met before measures those caches, not what a new voice costs. `new_voice` turns a clip into
another recording of the same voice: it starts a few milliseconds later (so every codec frame
covers other samples and every code can change) and is a little louder or softer (so its bytes
differ even where the start does not move it). Each (pass, request) pair gets its own version.
"""

from __future__ import annotations

import hashlib
import io

import numpy as np
import soundfile as sf

MAX_SKIP_S = 0.25  # the latest a new version of a clip starts, seconds
GAIN_RANGE = (0.8, 1.0)  # its gain (never louder: no clipping)


def _draw(salt: int, index: int) -> tuple[float, float]:
    """Two numbers in [0, 1) from (salt, index), the same in every client process."""
    digest = hashlib.blake2b(f"{salt}:{index}".encode(), digest_size=16).digest()
    a, b = np.frombuffer(digest, dtype="<u8")
    return float(a) / 2**64, float(b) / 2**64


def new_voice(wav: bytes, salt: int, index: int, min_seconds: float = 1.0) -> bytes:
    """`wav` (a WAV file's bytes) as another recording of its voice, chosen by `salt` (one per
    pass) and `index` (the request): the first 1..MAX_SKIP_S s dropped (less when the clip would
    fall under `min_seconds`), its gain in GAIN_RANGE; written as 16-bit PCM WAV. Bytes that are
    no audio file go as they are, for the server to refuse."""
    try:
        audio, rate = sf.read(io.BytesIO(wav), dtype="float32", always_2d=True)  # [T, channels]
    except (sf.LibsndfileError, RuntimeError, ValueError):
        return wav
    skip_draw, gain_draw = _draw(salt, index)
    room = max(0, len(audio) - int(min_seconds * rate))
    skip = min(room, 1 + int(skip_draw * MAX_SKIP_S * rate))
    gain = GAIN_RANGE[0] + gain_draw * (GAIN_RANGE[1] - GAIN_RANGE[0])
    out = io.BytesIO()
    sf.write(out, np.clip(audio[skip:] * gain, -1.0, 1.0), rate, subtype="PCM_16", format="WAV")
    return out.getvalue()
