"""Each response format, streamed chunk by chunk, decodes to the audio that went in."""

from __future__ import annotations

import numpy as np
import pytest

from api.audio_encoding import CONTENT_TYPES, make_encoder, wav_header
from tests.api.audio_decode import decode_audio, dominant_hz

FORMATS = ["pcm", "wav", "mp3", "opus", "aac", "flac"]


def sine_chunks(sample_rate: int, channels: int, seconds: float, hz: float = 440.0):
    """The engine's chunk schedule: 1 frame (80 ms), then 15-frame chunks, last partial."""
    total = int(seconds * sample_rate)
    t = np.arange(total) / sample_rate
    wave = (0.4 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    pcm = np.repeat(wave[:, None], channels, axis=1)  # [S, C]
    frame = sample_rate * 2 // 25
    bounds = [0, frame] + list(range(frame + 15 * frame, total, 15 * frame)) + [total]
    return [pcm[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rate,channels", [(48000, 2), (24000, 1)])
def test_streamed_file_decodes_to_input(fmt, rate, channels):
    encoder = make_encoder(fmt, rate, channels, streaming=True)
    assert encoder.content_type == CONTENT_TYPES[fmt]
    pieces = [encoder.encode(chunk) for chunk in sine_chunks(rate, channels, 2.0)]
    bytes_before_finish = sum(len(p) for p in pieces)
    pieces.append(encoder.finish())
    body = b"".join(pieces)
    # Streams while generating: most of the file exists before the encoder is closed.
    assert bytes_before_finish > 0.5 * len(body)
    pcm, got_rate = decode_audio(body, fmt, sample_rate=rate, channels=channels)
    # Opus decoders always output 48 kHz (the input rate is only advisory in OpusHead).
    assert got_rate == (48000 if fmt == "opus" else rate)
    assert pcm.shape[1] == channels
    assert abs(pcm.shape[0] / got_rate - 2.0) < 0.1, pcm.shape[0] / got_rate
    assert abs(dominant_hz(pcm, got_rate) - 440.0) < 5.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_whole_file_matches_streamed_content(fmt):
    encoder = make_encoder(fmt, 48000, 2, streaming=False)
    pieces = [encoder.encode(chunk) for chunk in sine_chunks(48000, 2, 1.5)]
    body = b"".join(pieces) + encoder.finish()
    pcm, rate = decode_audio(body, fmt, sample_rate=48000, channels=2)
    assert rate == 48000 and pcm.shape[1] == 2
    assert abs(pcm.shape[0] / rate - 1.5) < 0.1


def test_streaming_wav_header_has_unknown_sizes_and_whole_wav_exact_sizes():
    header = wav_header(48000, 2, None)
    assert len(header) == 44 and header[4:8] == b"\xff\xff\xff\xff" and header[40:44] == b"\xff\xff\xff\xff"
    encoder = make_encoder("wav", 24000, 1, streaming=False)
    encoder.encode(np.zeros((2400, 1), np.float32))
    body = encoder.finish()
    assert int.from_bytes(body[40:44], "little") == 4800 == len(body) - 44


@pytest.mark.parametrize("rate,channels", [(48000, 2), (24000, 1), (16000, 1)])
def test_first_chunk_of_a_compressed_stream_yields_bytes_at_once(rate, channels):
    """Time to first audio: one 80 ms chunk already produces container bytes (aac's encoder holds
    2,048 samples, so at 24 kHz and below its audio starts with the second chunk)."""
    chunks = sine_chunks(rate, channels, 1.0)
    for fmt in ("mp3", "opus", "aac"):
        encoder = make_encoder(fmt, rate, channels, streaming=True)
        first = encoder.encode(chunks[0])
        if fmt == "aac" and len(chunks[0]) < 2048:
            assert len(first + encoder.encode(chunks[1])) > 0, fmt
        else:
            assert len(first) > 0, fmt


def mp3_frames(data: bytes) -> int:
    """How many whole MPEG-1 Layer III frames `data` holds after its ID3v2 tag."""
    at = 10 + int.from_bytes(bytes(b & 0x7F for b in data[6:10]), "big") if data[:3] == b"ID3" else 0
    kbps = [0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320]
    count = 0
    while at + 4 <= len(data) and data[at] == 0xFF and data[at + 1] & 0xFE == 0xFA:
        bitrate, rate = data[at + 2] >> 4, data[at + 2] >> 2 & 3
        if not 0 < bitrate < 15 or rate == 3:  # free format or a reserved value: not LAME's CBR
            break
        length = 144_000 * kbps[bitrate] // (44100, 48000, 32000)[rate] + (data[at + 2] >> 1 & 1)
        if at + length > len(data):
            break
        at, count = at + length, count + 1
    return count


def test_streamed_mp3_gives_each_frame_as_soon_as_it_is_encoded():
    """The first 80 ms chunk (3,840 samples a channel) has LAME encode two frames of 1,152; both
    leave at once (no bit reservoir holding one back until the next frame settles its bytes)."""
    encoder = make_encoder("mp3", 48000, 2, streaming=True)
    assert mp3_frames(encoder.encode(sine_chunks(48000, 2, 1.0)[0])) >= 2


def test_pcm_clips_out_of_range_samples():
    out = make_encoder("pcm", 24000, 1, streaming=True).encode(np.array([[2.0], [-3.0], [0.5]], np.float32))
    assert np.frombuffer(out, "<i2").tolist() == [32767, -32767, 16384]


@pytest.mark.parametrize("speed", [0.5, 2.0, 4.0])
@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
def test_speed_changes_duration_not_pitch(fmt, speed):
    encoder = make_encoder(fmt, 24000, 1, streaming=True, speed=speed)
    body = b"".join(encoder.encode(c) for c in sine_chunks(24000, 1, 3.0)) + encoder.finish()
    pcm, rate = decode_audio(body, fmt, sample_rate=24000, channels=1)
    assert abs(pcm.shape[0] / rate - 3.0 / speed) < 0.15
    assert abs(dominant_hz(pcm, rate) - 440.0) < 10.0


def test_more_than_two_channels_refused():
    with pytest.raises(ValueError):
        make_encoder("mp3", 48000, 6, streaming=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("speed", [1.0, 2.0])
def test_empty_chunks_are_accepted(fmt, speed):
    """The engine's final chunk may carry no samples (found by the API fuzz pass)."""
    encoder = make_encoder(fmt, 48000, 2, streaming=True, speed=speed)
    empty = np.zeros((0, 2), np.float32)
    body = encoder.encode(empty) + encoder.encode(sine_chunks(48000, 2, 0.5)[0]) + encoder.encode(empty)
    body += encoder.finish()
    assert len(body) > 0


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "opus", "flac"])
@pytest.mark.parametrize("out_rate,speed", [(16000, 1.0), (22050, 1.0), (24000, 2.0)])
def test_output_rate_conversion_streams(fmt, out_rate, speed):
    encoder = make_encoder(fmt, 48000, 2, streaming=True, speed=speed, out_rate=out_rate)
    pieces = [encoder.encode(c) for c in sine_chunks(48000, 2, 2.0)]
    body = b"".join(pieces) + encoder.finish()
    pcm, rate = decode_audio(body, fmt, sample_rate=out_rate, channels=2)
    assert rate == (48000 if fmt == "opus" else out_rate)  # Opus decoders always give 48 kHz
    assert abs(pcm.shape[0] / rate - 2.0 / speed) < 0.12
    assert abs(dominant_hz(pcm, rate) - 440.0) < 10.0


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "flac"])
@pytest.mark.parametrize("channels_in,channels_out", [(2, 1), (1, 2)])
def test_channel_count_is_converted(fmt, channels_in, channels_out):
    """OpenAI's pcm layout from the 48 kHz stereo codec: mixed to mono, then resampled."""
    encoder = make_encoder(fmt, 48000, channels_in, streaming=True, out_rate=24000, out_channels=channels_out)
    body = b"".join(encoder.encode(c) for c in sine_chunks(48000, channels_in, 1.0)) + encoder.finish()
    pcm, rate = decode_audio(body, fmt, sample_rate=24000, channels=channels_out)
    assert rate == 24000 and pcm.shape[1] == channels_out
    assert abs(pcm.shape[0] / rate - 1.0) < 0.1
    assert abs(dominant_hz(pcm, rate) - 440.0) < 10.0
    assert abs(np.abs(pcm).max() - 0.4) < 0.05  # the same wave in both channels: mixing keeps its level


@pytest.mark.parametrize("speed,out_rate", [(1.0, None), (2.0, None), (0.5, 16000)])
def test_samples_count_what_the_file_holds(speed, out_rate):
    """The audio's length as reported (X-Audio-Seconds) is the file's, after speed and rate."""
    encoder = make_encoder("pcm", 48000, 2, streaming=True, speed=speed, out_rate=out_rate, out_channels=1)
    body = b"".join(encoder.encode(c) for c in sine_chunks(48000, 2, 2.0)) + encoder.finish()
    assert encoder.samples == len(body) // 2
    assert abs(encoder.samples / (out_rate or 48000) - 2.0 / speed) < 0.05


@pytest.mark.parametrize("fmt", ["ulaw", "alaw"])
def test_g711_telephony_formats_stream_one_byte_a_sample(fmt):
    """μ-law and A-law at 8 kHz mono (phone lines): one byte a sample, no header, and the
    decoded wave is the tone that went in."""
    encoder = make_encoder(fmt, 48000, 2, streaming=True, out_rate=8000, out_channels=1)
    pieces = [encoder.encode(c) for c in sine_chunks(48000, 2, 1.0)]
    body = b"".join(pieces) + encoder.finish()
    assert sum(len(p) for p in pieces) > 0.9 * len(body)
    assert abs(len(body) - 8000) < 200 and encoder.samples == len(body)
    pcm, rate = decode_audio(body, fmt, sample_rate=8000, channels=1)
    assert rate == 8000 and abs(dominant_hz(pcm, rate) - 440.0) < 10.0
    assert abs(np.abs(pcm).max() - 0.4) < 0.05


def _encoded(fmt: str, bit_rate: int, seconds: float = 3.0) -> bytes:
    encoder = make_encoder(fmt, 48000, 2, streaming=True, out_rate=48000 if fmt == "opus" else 44100,
                           out_channels=1, bit_rate=bit_rate)
    return b"".join(encoder.encode(c) for c in sine_chunks(48000, 2, seconds)) + encoder.finish()


@pytest.mark.parametrize("bit_rate", [32_000, 128_000, 192_000])
def test_an_mp3_bit_rate_is_the_files_bit_rate(bit_rate):
    assert 0.85 < len(_encoded("mp3", bit_rate)) * 8 / 3.0 / bit_rate < 1.15


def test_an_opus_bit_rate_sets_the_size_of_the_file():
    """Opus is variable-rate (and Ogg pages add their own bytes): a higher rate, a larger file."""
    assert len(_encoded("opus", 128_000)) > 2 * len(_encoded("opus", 32_000))


def test_a_bit_rate_for_a_format_without_one_is_refused():
    with pytest.raises(ValueError, match="no bit rate"):
        make_encoder("pcm", 48000, 2, streaming=True, bit_rate=64_000)


def test_a_whole_flac_file_states_its_length():
    """soundfile (libsndfile) reads a FLAC's length from its header: a whole file states it."""
    import io

    import soundfile

    encoder = make_encoder("flac", 48000, 2, streaming=False)
    body = b"".join(encoder.encode(c) for c in sine_chunks(48000, 2, 1.5)) + encoder.finish()
    audio, rate = soundfile.read(io.BytesIO(body))
    assert rate == 48000 and audio.shape == (72000, 2)


@pytest.mark.parametrize("fmt,speed", [("wav", 1.0), ("flac", 1.0), ("mp3", 0.5), ("pcm", 1.0)])
def test_a_whole_file_encoder_states_the_bytes_it_holds_back(fmt, speed):
    """What a whole-file encoder keeps until ``finish`` is counted (the server bounds a whole
    response by it): it grows with the audio and is handed out, and zero, at the end."""
    encoder = make_encoder(fmt, 24000, 1, streaming=False, speed=speed)
    given = b"".join(encoder.encode(chunk) for chunk in sine_chunks(24000, 1, 4.0))
    if fmt != "pcm":
        assert encoder.held_bytes > 16_000 and not given
    tail = encoder.finish()
    assert encoder.held_bytes == 0 and len(given + tail) > 16_000
