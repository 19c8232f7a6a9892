"""Reference-audio preparation: channel rules, resampling, loudness clamp, file decoding."""

import io

import numpy as np
import pytest
import soundfile as sf

from stages.models.codec.audio_prep import (
    loudness_gain_db,
    normalize_loudness,
    prepare_reference,
    read_audio,
    resample,
    to_channels,
)


def tone(freq: float, rate: int, seconds: float, amp: float = 0.1) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def test_v2_channel_rules():
    mono = tone(440, 16000, 0.1)
    dup = to_channels(mono, 2)
    assert dup.shape == (2, mono.size)
    np.testing.assert_array_equal(dup[0], dup[1])
    four = np.stack([mono * (i + 1) for i in range(4)])
    cut = to_channels(four, 2)
    np.testing.assert_array_equal(cut, four[:2])


def test_v1_channel_rule_is_mean():
    left, right = tone(440, 16000, 0.1), tone(660, 16000, 0.1)
    mono = to_channels(np.stack([left, right]), 1)
    np.testing.assert_allclose(mono[0], (left + right) / 2, atol=1e-7)
    with pytest.raises(ValueError):
        to_channels(left, 3)


def test_resample_rate_and_length_keep_the_pitch():
    rate_in, rate_out = 16000, 48000
    wav = tone(440, rate_in, 1.0)[None, :]
    out = resample(wav, rate_in, rate_out)
    assert out.dtype == np.float32 and out.shape[0] == 1
    assert abs(out.shape[1] - 3 * wav.shape[1]) <= 1
    spectrum = np.abs(np.fft.rfft(out[0]))
    peak_hz = np.argmax(spectrum) * rate_out / out.shape[1]
    assert abs(peak_hz - 440) < 2
    assert resample(wav, rate_in, rate_in) is wav


@pytest.mark.parametrize("amp, expected_gain", [(0.001, 3.0), (0.9, -3.0)])
def test_loudness_gain_is_clamped(amp, expected_gain):
    wav = tone(440, 16000, 0.5, amp)[None, :]
    assert loudness_gain_db(wav) == pytest.approx(expected_gain)
    out = normalize_loudness(wav)
    np.testing.assert_allclose(out, wav * 10 ** (expected_gain / 20), rtol=1e-6)


def test_loudness_inside_the_window_reaches_minus_20_dbfs():
    # a sine of amplitude a has power a^2/2; a = 0.12 is about -21.9 dBFS, within 3 dB of -20
    wav = tone(440, 16000, 1.0, 0.12)[None, :]
    gain = loudness_gain_db(wav)
    assert 0 < gain < 3
    out = normalize_loudness(wav)
    assert 10 * np.log10(np.mean(out.astype(np.float64) ** 2)) == pytest.approx(-20.0, abs=1e-3)


def test_loudness_is_computed_on_all_channels_together():
    quiet, loud = tone(440, 16000, 0.5, 0.05), tone(440, 16000, 0.5, 0.2)
    both = np.stack([quiet, loud])
    gain = 10 ** (loudness_gain_db(both) / 20)
    np.testing.assert_allclose(normalize_loudness(both), both * gain, rtol=1e-6)


def test_prepare_reference_for_v2_codec_from_a_wav_file():
    rate = 22050
    mono = tone(300, rate, 0.5)
    buf = io.BytesIO()
    sf.write(buf, mono, rate, format="WAV", subtype="PCM_16")
    wav, read_rate = read_audio(buf.getvalue())
    assert read_rate == rate and wav.shape == (1, mono.size)
    out = prepare_reference(wav, read_rate, target_rate=48000, channels=2)
    assert out.dtype == np.float32 and out.shape[0] == 2
    assert abs(out.shape[1] - round(mono.size * 48000 / rate)) <= 1
    np.testing.assert_array_equal(out[0], out[1])
    power_db = 10 * np.log10(np.mean(out.astype(np.float64) ** 2))
    assert power_db == pytest.approx(10 * np.log10(np.mean(mono.astype(np.float64) ** 2)) + 3, abs=0.1)


@pytest.mark.parametrize("rate", [16000, 44100])
def test_mono_for_a_two_channel_codec_is_the_upstream_order_to_the_sample(rate):
    """Resampled once and then duplicated: the same samples as upstream's order (duplicate,
    resample both, normalise)."""
    mono = (0.1 * np.random.default_rng(rate).standard_normal((1, rate))).astype(np.float32)
    upstream = normalize_loudness(resample(to_channels(mono, 2), rate, 48000))
    for wav in (mono, mono[0]):
        np.testing.assert_array_equal(prepare_reference(wav, rate, target_rate=48000, channels=2), upstream)
