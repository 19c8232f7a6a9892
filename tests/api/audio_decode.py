"""Test helper: decode any response body with soundfile / PyAV -> (float32 [S, C], rate)."""

from __future__ import annotations

import io

import av
import numpy as np
import soundfile


def decode_audio(data: bytes, fmt: str, *, sample_rate: int = 0, channels: int = 0) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        pcm = np.frombuffer(data, "<i2").astype(np.float32) / 32767.0
        return pcm.reshape(-1, channels), sample_rate
    if fmt in ("wav", "flac"):
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            if f.frames < 2**31:  # a streamed file leaves its length unknown; PyAV reads those
                return f.read(dtype="float32", always_2d=True), f.samplerate
    if fmt in ("ulaw", "alaw"):  # raw G.711: no header, the layout must be given
        container = av.open(io.BytesIO(data), format={"ulaw": "mulaw", "alaw": "alaw"}[fmt],
                            options={"sample_rate": str(sample_rate), "ch_layout": "mono"})
    else:
        container = av.open(io.BytesIO(data))
    parts, rate = [], 0
    for frame in container.decode(audio=0):
        rate = frame.sample_rate
        arr = frame.to_ndarray()
        if frame.format.is_planar:
            arr = arr.T  # [S, C]
        else:
            arr = arr.reshape(-1, frame.layout.nb_channels)
        if arr.dtype == np.int16:
            arr = arr.astype(np.float32) / 32768.0
        parts.append(arr.astype(np.float32))
    container.close()
    return np.concatenate(parts), rate


def dominant_hz(pcm: np.ndarray, sample_rate: int) -> float:
    mono = pcm.mean(axis=1)
    spectrum = np.abs(np.fft.rfft(mono * np.hanning(len(mono))))
    return float(np.fft.rfftfreq(len(mono), 1 / sample_rate)[np.argmax(spectrum)])
