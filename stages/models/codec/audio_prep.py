"""Reference audio for a codec: read, fix the channel count, resample, normalise loudness.

The processor rules of docs/model_facts.md, "Reference audio", in upstream's order (channels, resample, loudness):

* v2 codec (2 channels, 48 kHz): mono is duplicated to 2 channels, more than 2 are cut to the
  first 2.
* v1 codec (1 channel, 24 kHz): channels are averaged to mono.
* loudness: `gain_dB = clamp(-20 - 10*log10(mean(x^2) + 1e-9), -3, +3)` over the whole
  (multi-channel) array.

Resampling uses soxr (high quality); upstream uses torchaudio's sinc resampler, which has no build
for every torch version, so the samples differ slightly from upstream but not the rules.
soundfile and soxr are imported when first used, so code that never touches reference audio
(a GPU benchmark image without them, say) can import this module.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

TARGET_DBFS = -20.0
MAX_GAIN_DB = 3.0


def read_audio(source: str | Path | bytes) -> tuple[np.ndarray, int]:
    """Decode a WAV/FLAC/OGG file or its bytes: (float32 `[channels, samples]`, sample rate)."""
    import soundfile as sf

    handle = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source)
    data, rate = sf.read(handle, dtype="float32", always_2d=True)  # [N, C]
    return np.ascontiguousarray(data.T), int(rate)


def to_channels(wav: np.ndarray, channels: int) -> np.ndarray:
    """`[C, N]` (or `[N]`) -> `[channels, N]` by the codec's rule: 2 = duplicate/cut, 1 = mean."""
    wav = np.asarray(wav, dtype=np.float32)
    if wav.ndim == 1:
        wav = wav[None, :]
    if wav.ndim != 2 or wav.shape[0] == 0:
        raise ValueError(f"audio must be [channels, samples], got shape {wav.shape}")
    if channels == 1:
        return wav.mean(axis=0, keepdims=True) if wav.shape[0] > 1 else wav
    if channels == 2:
        if wav.shape[0] == 1:
            return np.repeat(wav, 2, axis=0)
        return wav[:2]
    raise ValueError(f"codec channel count must be 1 or 2, got {channels}")


def resample(wav: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Resample `[C, N]` from `rate_in` to `rate_out` Hz (soxr, high quality)."""
    if rate_in == rate_out:
        return wav
    import soxr

    out = soxr.resample(np.ascontiguousarray(wav.T), rate_in, rate_out, quality="HQ")  # [M, C]
    return np.ascontiguousarray(out.T, dtype=np.float32)


def loudness_gain_db(wav: np.ndarray) -> float:
    """The gain that brings the mean power to -20 dBFS, clamped to ±3 dB."""
    power = float(np.mean(np.square(wav, dtype=np.float64))) if wav.size else 0.0
    gain = TARGET_DBFS - 10.0 * np.log10(power + 1e-9)
    return float(np.clip(gain, -MAX_GAIN_DB, MAX_GAIN_DB))


def normalize_loudness(wav: np.ndarray) -> np.ndarray:
    if wav.size == 0:
        return wav
    return (wav * np.float32(10.0 ** (loudness_gain_db(wav) / 20.0))).astype(np.float32)


def prepare_reference(wav: np.ndarray, rate: int, *, target_rate: int, channels: int) -> np.ndarray:
    """Reference clip -> float32 `[channels, M]` at `target_rate`, ready for `CodecRunner.encode`."""
    if rate <= 0:
        raise ValueError(f"sample rate must be positive, got {rate}")
    wav = np.asarray(wav, dtype=np.float32)
    if channels == 2 and (wav.ndim == 1 or wav.shape[0] == 1):
        # mono for a 2-channel codec: resampled once, then duplicated (the same samples as
        # duplicating first, as the resampler treats channels alike, for half its time)
        return normalize_loudness(to_channels(resample(to_channels(wav, 1), rate, target_rate), 2))
    fixed = to_channels(wav, channels)  # [channels, N]
    return normalize_loudness(resample(fixed, rate, target_rate))
