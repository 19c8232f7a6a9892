"""Streaming audio encoders: float32 PCM chunks in, the bytes of ONE continuous file out.

Every response format is produced incrementally from one encoder per request: raw s16le PCM, WAV
with a streaming header (sizes 0xFFFFFFFF), mp3 / opus-in-Ogg / aac-ADTS / flac muxed by PyAV
(FFmpeg) into one container whose bytes are handed out as packets are written, and raw G.711
μ-law / A-law (``ulaw``, ``alaw``: telephony, 8 bits a sample, no header) through the same path.
Those two are not OpenAI formats: only the ElevenLabs-compatible endpoints ask for them. Another
channel count is mixed first (mono = the mean of the channels, stereo = mono doubled), ``speed``
other than 1 is applied with FFmpeg's ``atempo`` filter and another output rate with FFmpeg's
resampler, all streaming as well. ``AudioEncoder.samples`` counts the samples per channel that
went into the file, so the audio's length is known after speed and rate changes.

A streamed FLAC cannot state its length (STREAMINFO comes first and the muxer cannot seek back),
so its total-sample count says "unknown": FFmpeg and browsers read such a file, libsndfile
(soundfile) opens it but reports an unbounded length. A whole FLAC file states its length.
"""

from __future__ import annotations

import io
import struct
from abc import ABC, abstractmethod
from types import ModuleType

import numpy as np

# Output rates a request may ask for (``sample_rate``); the model's own rate is always allowed.
OUTPUT_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)

CONTENT_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "ulaw": "audio/basic",
    "alaw": "audio/x-alaw-basic",
}

# response_format -> (FFmpeg muxer, encoder, default bit rate per channel or None)
_CONTAINERS = {
    "mp3": ("mp3", "libmp3lame", 64_000),
    "opus": ("ogg", "libopus", 48_000),
    "aac": ("adts", "aac", 64_000),
    "flac": ("flac", "flac", None),
    "ulaw": ("mulaw", "pcm_mulaw", None),
    "alaw": ("alaw", "pcm_alaw", None),
}
# Encoder options for a streamed response. LAME's bit reservoir lets a frame borrow bytes that a
# later frame carries, so each frame leaves the encoder a frame late; without it the first 80 ms
# chunk already yields two frames (a little quality at the same bit rate for earlier audio).
_STREAMING_OPTIONS = {"mp3": {"reservoir": "0"}}
# the formats whose bit rate a request may set (``bit_rate`` of `make_encoder`)
BIT_RATE_FORMATS = ("mp3", "opus", "aac")


class FFmpegUnavailable(RuntimeError):
    """PyAV (FFmpeg) cannot be imported here: only raw PCM and WAV at the model's own rate and
    channels can be encoded."""


def _ffmpeg() -> ModuleType:
    """PyAV (FFmpeg), imported when a request first needs it (after that a lookup in
    `sys.modules`): raw PCM and WAV at the model's own rate and channels never do, so an API
    process serving only those never loads it."""
    try:
        import av
        import av.filter  # noqa: F401  (the atempo graph)
    except ImportError as exc:
        raise FFmpegUnavailable(f"this server cannot encode compressed audio or change its rate, "
                                f"channels or speed: PyAV (FFmpeg) is not installed ({exc})") from None
    return av


def _layout(channels: int) -> str:
    if channels == 1:
        return "mono"
    if channels == 2:
        return "stereo"
    raise ValueError(f"{channels} audio channels are not supported (1 or 2)")


def float_to_s16le(pcm: np.ndarray) -> bytes:
    """[S, C] float32 in [-1, 1] -> interleaved little-endian int16 bytes (clipped)."""
    scaled = np.clip(pcm, -1.0, 1.0) * 32767.0  # [S, C]
    return np.rint(scaled).astype("<i2").tobytes()


class AudioEncoder(ABC):
    """One request's encoder. ``encode`` may return b"" while the codec buffers."""

    content_type: str
    heavy = False  # True: milliseconds per chunk (a real codec); run it off the event loop
    samples = 0  # samples per channel handed to the file so far (at the output rate)

    @property
    def held_bytes(self) -> int:
        """Bytes of the file the encoder holds back until ``finish`` (a whole file's body)."""
        return 0

    @abstractmethod
    def encode(self, pcm: np.ndarray) -> bytes:
        """Append ``pcm`` ([samples, channels] float32); return the bytes now ready."""

    @abstractmethod
    def finish(self) -> bytes:
        """Flush the codec and close the container; return the remaining bytes."""


class PcmEncoder(AudioEncoder):
    content_type = CONTENT_TYPES["pcm"]

    def encode(self, pcm: np.ndarray) -> bytes:
        self.samples += pcm.shape[0]
        return float_to_s16le(pcm)

    def finish(self) -> bytes:
        return b""


def wav_header(sample_rate: int, channels: int, data_bytes: int | None) -> bytes:
    """44-byte RIFF/WAVE header for 16-bit PCM; ``None`` = unknown length (streaming)."""
    data_size = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff_size = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    block_align = 2 * channels
    return (
        b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block_align,
                                block_align, 16)
        + b"data" + struct.pack("<I", data_size)
    )


class WavEncoder(AudioEncoder):
    """Streaming: header with unknown sizes first. Whole file: exact sizes, bytes at finish."""

    content_type = CONTENT_TYPES["wav"]

    def __init__(self, sample_rate: int, channels: int, *, streaming: bool) -> None:
        self.sample_rate = sample_rate
        self.channels = channels
        self.streaming = streaming
        self._header_sent = False
        self._held: list[bytes] = []
        self._held_bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def encode(self, pcm: np.ndarray) -> bytes:
        self.samples += pcm.shape[0]
        data = float_to_s16le(pcm)
        if not self.streaming:
            self._held.append(data)
            self._held_bytes += len(data)
            return b""
        if not self._header_sent:
            self._header_sent = True
            return wav_header(self.sample_rate, self.channels, None) + data
        return data

    def finish(self) -> bytes:
        if self.streaming:
            return b"" if self._header_sent else wav_header(self.sample_rate, self.channels, None)
        data = b"".join(self._held)
        self._held.clear()
        self._held_bytes = 0
        return wav_header(self.sample_rate, self.channels, len(data)) + data


class _ByteSink:
    """Write-only file for PyAV: collects what the muxer writes until ``drain``.

    It has no ``seek``, so muxers write straight through (the flac muxer then leaves STREAMINFO's
    total-sample count at 0 = unknown, which decoders accept)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        return len(data)

    def drain(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class ContainerEncoder(AudioEncoder):
    """mp3 / opus (Ogg) / aac (ADTS) / flac / μ-law / A-law through one PyAV encoder and muxer
    per request. ``bit_rate`` (bits per second, all channels) replaces the format's default."""

    heavy = True

    def __init__(self, fmt: str, sample_rate: int, channels: int, *, streaming: bool,
                 bit_rate: int | None = None) -> None:
        muxer, codec, default_rate = _CONTAINERS[fmt]
        self.content_type = CONTENT_TYPES[fmt]
        self.streaming = streaming
        self._layout = _layout(channels)
        self._in_rate = sample_rate
        self._sink: _ByteSink | io.BytesIO = _ByteSink() if streaming else io.BytesIO()
        options = {"page_duration": "20000"} if muxer == "ogg" else {}  # one Ogg page per ~20 ms
        av = _ffmpeg()
        self._container = av.open(self._sink, mode="w", format=muxer, options=options,
                                  container_options={"flush_packets": "1"}, buffer_size=4096)
        rates = av.codec.Codec(codec, "w").audio_rates
        out_rate = sample_rate if not rates or sample_rate in rates else (48000 if 48000 in rates else max(rates))
        self._stream = self._container.add_stream(
            codec, rate=out_rate, layout=self._layout,
            options=_STREAMING_OPTIONS.get(fmt, {}) if streaming else {})
        if bit_rate or default_rate:
            self._stream.codec_context.bit_rate = bit_rate or default_rate * channels
        self._pts = 0
        self._closed = False

    def encode(self, pcm: np.ndarray) -> bytes:
        if pcm.shape[0] == 0:
            return b""
        planar = np.ascontiguousarray(pcm.T, dtype=np.float32)  # [C, S]
        frame = _ffmpeg().AudioFrame.from_ndarray(planar, format="fltp", layout=self._layout)
        frame.sample_rate = self._in_rate
        frame.pts = self._pts
        self._pts += pcm.shape[0]
        self.samples += pcm.shape[0]
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._take()

    def finish(self) -> bytes:
        if self._closed:
            return b""
        self._closed = True
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        if isinstance(self._sink, io.BytesIO):
            return self._sink.getvalue()
        return self._sink.drain()

    def _take(self) -> bytes:
        return self._sink.drain() if isinstance(self._sink, _ByteSink) else b""

    @property
    def held_bytes(self) -> int:
        return self._sink.getbuffer().nbytes if isinstance(self._sink, io.BytesIO) and not self._closed else 0


class ChannelMix:
    """Another channel count: stereo to mono is the mean of the two, mono to stereo doubles it."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        _layout(channels_in)
        _layout(channels_out)
        self.channels_out = channels_out

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """[S, C_in] float32 -> [S, C_out] float32."""
        mono = pcm.mean(axis=1, keepdims=True, dtype=np.float32)  # [S, 1]
        return np.repeat(mono, self.channels_out, axis=1) if self.channels_out > 1 else mono

    def flush(self) -> np.ndarray:
        return np.zeros((0, self.channels_out), np.float32)


class SpeedChange:
    """Streaming tempo change without pitch change (FFmpeg ``atempo``), PCM in, PCM out."""

    def __init__(self, speed: float, sample_rate: int, channels: int) -> None:
        self.channels = channels
        self._layout = _layout(channels)
        self._rate = sample_rate
        self._graph = _ffmpeg().filter.Graph()
        src = self._graph.add_abuffer(format="flt", sample_rate=sample_rate, layout=self._layout,
                                      time_base=f"1/{sample_rate}")
        last = src
        for factor in _atempo_factors(speed):
            node = self._graph.add("atempo", f"{factor:.6f}")
            last.link_to(node)
            last = node
        sink = self._graph.add("abuffersink")
        last.link_to(sink)
        self._graph.configure()
        self._pts = 0

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """[S, C] float32 -> [S', C] float32 (whatever the filter has ready)."""
        frame = _interleaved_frame(pcm, self._layout, self._rate, self._pts)
        self._pts += pcm.shape[0]
        self._graph.push(frame)
        return self._pull()

    def flush(self) -> np.ndarray:
        self._graph.push(None)
        return self._pull()

    def _pull(self) -> np.ndarray:
        parts, av = [], _ffmpeg()
        while True:
            try:
                frame = self._graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                break
            parts.append(frame.to_ndarray().reshape(-1, self.channels))  # [S, C]
        if not parts:
            return np.zeros((0, self.channels), np.float32)
        return np.concatenate(parts).astype(np.float32, copy=False)


def _interleaved_frame(pcm: np.ndarray, layout: str, rate: int, pts: int):
    """[S, C] float32 PCM as one packed-float FFmpeg frame at ``rate`` starting at ``pts``."""
    interleaved = np.ascontiguousarray(pcm, dtype=np.float32).reshape(1, -1)  # [1, S*C]
    frame = _ffmpeg().AudioFrame.from_ndarray(interleaved, format="flt", layout=layout)
    frame.sample_rate = rate
    frame.pts = pts
    return frame


def _atempo_factors(speed: float) -> list[float]:
    """Split ``speed`` into atempo stages each within [0.5, 2.0]."""
    factors = []
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    while speed > 2.0:
        factors.append(2.0)
        speed /= 2.0
    factors.append(speed)
    return factors


class RateChange:
    """Streaming sample-rate conversion (FFmpeg's swresample), PCM in, PCM out."""

    def __init__(self, rate_in: int, rate_out: int, channels: int) -> None:
        self.channels = channels
        self._layout = _layout(channels)
        self._rate_in = rate_in
        self._resampler = _ffmpeg().AudioResampler(format="flt", layout=self._layout, rate=rate_out)
        self._pts = 0

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """[S, C] float32 at ``rate_in`` -> [S', C] float32 at ``rate_out``."""
        frame = _interleaved_frame(pcm, self._layout, self._rate_in, self._pts)
        self._pts += pcm.shape[0]
        return self._collect(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        return self._collect(self._resampler.resample(None))

    def _collect(self, frames: list) -> np.ndarray:
        parts = [f.to_ndarray().reshape(-1, self.channels) for f in frames]  # [S, C] each
        if not parts:
            return np.zeros((0, self.channels), np.float32)
        return np.concatenate(parts).astype(np.float32, copy=False)


class StagedEncoder(AudioEncoder):
    """PCM stages (tempo, rate) in front of an encoder; flushing runs through every stage."""

    heavy = True

    def __init__(self, inner: AudioEncoder, stages: list) -> None:
        self.inner = inner
        self.stages = stages
        self.content_type = inner.content_type

    @property
    def samples(self) -> int:  # type: ignore[override]
        return self.inner.samples

    @property
    def held_bytes(self) -> int:
        return self.inner.held_bytes

    def encode(self, pcm: np.ndarray) -> bytes:
        if pcm.shape[0] == 0:  # the final chunk may be empty; FFmpeg refuses empty frames
            return b""
        return self._through(pcm, 0)

    def finish(self) -> bytes:
        out = b""
        for index, stage in enumerate(self.stages):
            tail = stage.flush()
            if tail.shape[0]:
                out += self._through(tail, index + 1)
        return out + self.inner.finish()

    def _through(self, pcm: np.ndarray, first_stage: int) -> bytes:
        for stage in self.stages[first_stage:]:
            pcm = stage.process(pcm)
            if pcm.shape[0] == 0:
                return b""
        return self.inner.encode(pcm)


def make_encoder(fmt: str, sample_rate: int, channels: int, *, streaming: bool,
                 speed: float = 1.0, out_rate: int | None = None,
                 out_channels: int | None = None, bit_rate: int | None = None) -> AudioEncoder:
    """The encoder for ``response_format`` ``fmt`` (one of ``CONTENT_TYPES``): PCM at
    ``sample_rate`` with ``channels`` in, a file at ``out_rate`` with ``out_channels`` (default:
    the same) out, at ``bit_rate`` bits per second where the format has one (`BIT_RATE_FORMATS`;
    default: the format's own)."""
    _layout(channels)
    if bit_rate is not None and fmt not in BIT_RATE_FORMATS:
        raise ValueError(f"response_format {fmt!r} has no bit rate to set")
    out_rate = out_rate or sample_rate
    out_channels = out_channels or channels
    if fmt == "pcm":
        encoder: AudioEncoder = PcmEncoder()
    elif fmt == "wav":
        encoder = WavEncoder(out_rate, out_channels, streaming=streaming)
    elif fmt in _CONTAINERS:
        encoder = ContainerEncoder(fmt, out_rate, out_channels, streaming=streaming, bit_rate=bit_rate)
    else:
        raise ValueError(f"unknown response_format {fmt!r}")
    stages: list = []
    if out_channels != channels:  # first: fewer channels make the later stages cheaper
        stages.append(ChannelMix(channels, out_channels))
    if speed != 1.0:
        stages.append(SpeedChange(speed, sample_rate, out_channels))
    if out_rate != sample_rate:
        stages.append(RateChange(sample_rate, out_rate, out_channels))
    return StagedEncoder(encoder, stages) if stages else encoder
