"""Reference audio decoded within bounds: a small file never becomes a large array.

A compressed clip can declare minutes of many channels at a high rate in a few hundred kilobytes
(ten minutes of 8-channel silence is a 237 KB FLAC). :func:`decode_reference` therefore

1. reads the container's header first (libsndfile, else FFmpeg through PyAV) and refuses, before
   decoding a sample, a rate above ``DecodeBounds.max_rate``, more channels than
   ``DecodeBounds.max_channels``, or a declared length past ``DecodeBounds.max_seconds``;
2. decodes in pieces of at most ``PIECE_FRAMES`` frames, fixing each piece to the codec's channel
   count as it comes (``stages.models.codec.audio_prep.to_channels``: a row-wise rule, so piece by
   piece equals the whole clip at once), and stops as soon as the decoded length passes
   ``max_seconds`` (a header that states no length, or a false one, decodes no further).

So one decode holds at most ``max_seconds x max_rate x codec channels`` float32 samples plus one
piece, whatever the file says. ``ReferenceDecodeTooLong`` carries what was measured for the
caller's error message. FFmpeg may pick only demuxers of self-contained audio files
(``SELF_CONTAINED_FORMATS``) and may open no protocol, so bytes written as a concat list, a
playlist or an image sequence cannot make it read other files.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import soundfile

from stages.models.codec.audio_prep import to_channels

PIECE_FRAMES = 65536  # frames decoded at once (a piece of 8-channel float32 audio: 2 MiB)
_UNKNOWN_FRAMES = 1 << 62  # libsndfile reports SF_COUNT_MAX when the header states no length

# FFmpeg demuxers of audio files that cannot name other files or URLs (no concat, HLS/DASH,
# playlists, image sequences); the MP4 demuxer leaves external data references off by default.
SELF_CONTAINED_FORMATS = ("wav", "flac", "mp3", "ogg", "aac", "mov", "matroska")
_PYAV_OPTIONS = {"format_whitelist": ",".join(SELF_CONTAINED_FORMATS),
                 "protocol_whitelist": "none"}  # no demuxer may open a nested file or URL


@dataclass(frozen=True)
class DecodeBounds:
    """What one reference decode may produce."""

    max_seconds: float
    max_channels: int  # channels the file may have (the decoded array has ``channels``)
    max_rate: int  # Hz
    channels: int  # the codec's channel count: every piece is fixed to it as decoded

    def max_frames(self, rate: int) -> int:
        """Frames past which a clip at ``rate`` is too long (the first frame beyond the limit)."""
        return int(self.max_seconds * rate) + 1


class ReferenceDecodeError(ValueError):
    """The bytes are not a clip this server decodes (``str`` says why, for the client)."""


class ReferenceOutOfBounds(ReferenceDecodeError):
    """The clip's header states a rate or channel count past the bounds (``limit``: the profile
    field that sets the bound)."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class ReferenceDecodeTooLong(ReferenceDecodeError):
    """Longer than ``max_seconds``: ``seconds`` is the header's length, or what was decoded before
    stopping (``at_least``)."""

    def __init__(self, seconds: float, *, at_least: bool) -> None:
        super().__init__(f"{'at least ' if at_least else ''}{seconds:.2f} s")
        self.seconds = seconds
        self.at_least = at_least


class PyAvMissing(ReferenceDecodeError):
    """libsndfile cannot read the bytes and PyAV (FFmpeg) is not installed."""


def decode_reference(data: bytes, bounds: DecodeBounds) -> tuple[np.ndarray, int]:
    """Encoded audio → (float32 ``[bounds.channels, samples]``, sample rate), within ``bounds``.
    ``ReferenceDecodeError`` (one of its kinds above) for anything else."""
    try:
        handle = soundfile.SoundFile(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError):
        handle = None
    if handle is not None:
        with handle:
            return _decode_libsndfile(handle, bounds)
    try:  # FFmpeg only for what libsndfile cannot read (MP3, AAC, Opus, WebM): loaded then
        import av
    except ImportError:
        raise PyAvMissing("PyAV is not installed") from None
    try:
        return _decode_pyav(av, data, bounds)
    except ReferenceDecodeError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError, StopIteration, MemoryError) as exc:
        raise ReferenceDecodeError(type(exc).__name__) from None


def _check_header(rate: int, channels: int, frames: int | None, bounds: DecodeBounds) -> None:
    if rate <= 0 or channels <= 0:
        raise ReferenceDecodeError("no audio stream")
    if rate > bounds.max_rate:
        raise ReferenceOutOfBounds(f"its sample rate is {rate} Hz; at most {bounds.max_rate} Hz is "
                                   f"accepted (api.max_ref_sample_rate)", "api.max_ref_sample_rate")
    if channels > bounds.max_channels:
        raise ReferenceOutOfBounds(f"it has {channels} channels; at most {bounds.max_channels} are "
                                   f"accepted (api.max_ref_channels)", "api.max_ref_channels")
    if frames is not None and frames >= bounds.max_frames(rate):
        raise ReferenceDecodeTooLong(frames / rate, at_least=False)


class _Pieces:
    """Decoded pieces fixed to the codec's channels, counted against the bound."""

    def __init__(self, rate: int, bounds: DecodeBounds) -> None:
        self.rate, self.bounds = rate, bounds
        self.limit = bounds.max_frames(rate)
        self.frames = 0
        self.parts: list[np.ndarray] = []

    def add(self, planar: np.ndarray) -> None:
        """``planar`` [file channels, n] float32; ``ReferenceDecodeTooLong`` once past the bound."""
        self.frames += planar.shape[1]
        if self.frames >= self.limit:
            raise ReferenceDecodeTooLong(self.frames / self.rate, at_least=True)
        # a copy: a slice of the piece would keep the whole piece (every channel) alive
        self.parts.append(np.array(to_channels(planar, self.bounds.channels), dtype=np.float32, order="C"))

    def result(self) -> tuple[np.ndarray, int]:
        if not self.parts:
            return np.zeros((self.bounds.channels, 0), np.float32), self.rate
        return np.ascontiguousarray(np.concatenate(self.parts, axis=1), dtype=np.float32), self.rate


def _decode_libsndfile(handle: soundfile.SoundFile, bounds: DecodeBounds) -> tuple[np.ndarray, int]:
    rate, channels = int(handle.samplerate), int(handle.channels)
    frames = int(handle.frames)
    _check_header(rate, channels, frames if 0 <= frames < _UNKNOWN_FRAMES else None, bounds)
    pieces = _Pieces(rate, bounds)
    try:
        while True:
            piece = handle.read(PIECE_FRAMES, dtype="float32", always_2d=True)  # [n, C]
            if not len(piece):
                return pieces.result()
            pieces.add(piece.T)
    except (soundfile.LibsndfileError, RuntimeError) as exc:
        raise ReferenceDecodeError(type(exc).__name__) from None


def _decode_pyav(av: ModuleType, data: bytes, bounds: DecodeBounds) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data), mode="r", options=dict(_PYAV_OPTIONS)) as container:
        if container.format.name.split(",")[0] not in SELF_CONTAINED_FORMATS:
            raise ReferenceDecodeError(f"container format {container.format.name} is not accepted")
        stream = next(s for s in container.streams if s.type == "audio")
        rate = int(stream.codec_context.sample_rate or 0)
        channels = int(stream.codec_context.channels or 0)
        _check_header(rate, channels, _declared_frames(stream, container, rate), bounds)
        layout = "mono" if channels == 1 else "stereo"
        resampler = av.AudioResampler(format="fltp", layout=layout, rate=rate)
        pieces = _Pieces(rate, bounds)
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                pieces.add(out.to_ndarray())  # [C, n]
        for out in resampler.resample(None):
            pieces.add(out.to_ndarray())
    if not pieces.frames:
        raise ReferenceDecodeError("no audio frames")
    return pieces.result()


def _declared_frames(stream, container, rate: int) -> int | None:
    """The length the container states (frames at ``rate``), or None."""
    if stream.duration is not None and stream.time_base is not None:
        return int(stream.duration * stream.time_base * rate)
    if container.duration is not None:  # microseconds
        return int(container.duration * rate / 1_000_000)
    return None
