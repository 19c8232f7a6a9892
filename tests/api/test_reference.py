"""Reference audio: every locator form, every common format, every validation error."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import socket

import numpy as np
import pytest
import soundfile

from api.audio_encoding import make_encoder
from api.errors import ApiError
from api.reference import ReferenceLoader, ReferencePolicy


def policy(tmp_path=None, **over):
    base = dict(min_seconds=1.0, max_seconds=30.0, max_bytes=2_000_000, allow_remote=False,
                allowed_local_paths=(str(tmp_path),) if tmp_path else (), sample_rate=24000, channels=1)
    base.update(over)
    return ReferencePolicy(**base)


def tone(seconds: float, rate: int = 16000, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return np.repeat((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)[:, None], channels, 1)  # [S, C]


def wav_bytes(seconds: float, rate: int = 16000, channels: int = 1, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    samples = np.rint(tone(seconds, rate, channels) * 32767).astype(np.int16)  # exact in any container
    soundfile.write(buf, samples, rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def encoded_bytes(fmt: str, seconds: float, rate: int = 48000, channels: int = 2) -> bytes:
    encoder = make_encoder(fmt, rate, channels, streaming=False)
    return encoder.encode(tone(seconds, rate, channels)) + encoder.finish()


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "aac"])
async def test_common_formats_decode_and_are_prepared_for_the_codec(fmt):
    data = encoded_bytes(fmt, 2.0)
    ref = await ReferenceLoader(policy()).load(base64.b64encode(data).decode())
    assert ref.wav.dtype == np.float32 and ref.wav.shape[0] == 1
    assert abs(ref.duration_s - 2.0) < 0.1
    assert abs(ref.wav.shape[1] / 24000 - ref.duration_s) < 0.01  # resampled to the codec rate


async def test_mono_is_duplicated_for_a_stereo_codec():
    ref = await ReferenceLoader(policy(sample_rate=48000, channels=2)).load(
        "data:audio/wav;base64," + base64.b64encode(wav_bytes(1.5)).decode())
    assert ref.wav.shape == (2, 72000)
    np.testing.assert_array_equal(ref.wav[0], ref.wav[1])


async def test_same_samples_in_different_containers_share_a_digest():
    loader = ReferenceLoader(policy())
    a = await loader.load(base64.b64encode(wav_bytes(1.5)).decode())
    b = await loader.load(base64.b64encode(wav_bytes(1.5, fmt="FLAC")).decode())
    c = await loader.load(base64.b64encode(wav_bytes(1.6)).decode())
    assert a.digest == b.digest != c.digest


async def test_local_path_only_under_allowed_directory(tmp_path):
    inside = tmp_path / "allowed"
    inside.mkdir()
    (inside / "ref.wav").write_bytes(wav_bytes(2.0))
    loader = ReferenceLoader(policy(inside))
    assert (await loader.load(f"file://{inside}/ref.wav")).duration_s == pytest.approx(2.0)
    assert (await loader.load(str(inside / "ref.wav"))).duration_s == pytest.approx(2.0)
    (tmp_path / "secret.wav").write_bytes(wav_bytes(2.0))
    for locator in (str(tmp_path / "secret.wav"), f"file://{inside}/../secret.wav", "/etc/passwd"):
        with pytest.raises(ApiError) as err:
            await loader.load(locator)
        assert err.value.status == 400 and "allowed" in err.value.message
    with pytest.raises(ApiError, match="not found"):
        await loader.load(str(inside / "missing.wav"))


async def test_remote_urls_refused_unless_allowed():
    with pytest.raises(ApiError) as err:
        await ReferenceLoader(policy()).load("https://example.com/a.wav")
    assert err.value.status == 400 and "allow_remote_ref_audio" in err.value.message


@pytest.mark.parametrize("seconds,word", [(0.5, "too short (0.50 s)"), (31.0, "too long (31.00 s)")])
async def test_duration_out_of_range_names_the_measured_duration(seconds, word):
    with pytest.raises(ApiError) as err:
        await ReferenceLoader(policy(max_bytes=10_000_000)).load(base64.b64encode(wav_bytes(seconds)).decode())
    assert err.value.status == 400 and word in err.value.message and err.value.param == "ref_audio"


@pytest.mark.parametrize("locator", [
    "not base64 at all!!",
    base64.b64encode(b"RIFF garbage that is no audio file" * 10).decode(),
    "data:audio/wav,plain-not-base64",
    "data:audio/wav;base64,@@@",
    "   ",
])
async def test_undecodable_reference_is_a_400(locator):
    with pytest.raises(ApiError) as err:
        await ReferenceLoader(policy()).load(locator)
    assert err.value.status == 400


async def test_oversized_reference_is_a_413():
    with pytest.raises(ApiError) as err:
        await ReferenceLoader(policy(max_bytes=4096)).load(base64.b64encode(wav_bytes(2.0)).decode())
    assert err.value.status == 413 and "4096" in err.value.message


def loopback_one(address) -> bool:
    """The tests' stand-in for "public": only 127.0.0.1 (a test cannot reach a public host)."""
    return str(address) == "127.0.0.1"


@contextlib.contextmanager
def http_files(root, host: str = "127.0.0.1", redirects: dict[str, str] | None = None):
    """A static file server on ``host`` (``redirects``: path -> Location answered 302); yields its
    base URL and the list of paths it was asked for."""
    import http.server
    import threading

    asked: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kw):
            super().__init__(*args, directory=str(root), **kw)

        def log_message(self, *args):
            pass

        def do_GET(self):
            asked.append(self.path)
            if redirects and self.path in redirects:
                self.send_response(302)
                self.send_header("Location", redirects[self.path])
                self.end_headers()
                return
            super().do_GET()

    server = http.server.ThreadingHTTPServer((host, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://{host}:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


async def test_remote_url_fetched_when_allowed(tmp_path):
    (tmp_path / "ref.wav").write_bytes(wav_bytes(2.0))
    with http_files(tmp_path) as (url, _):
        loader = ReferenceLoader(policy(allow_remote=True, address_allowed=loopback_one))
        assert (await loader.load(f"{url}/ref.wav")).duration_s == pytest.approx(2.0)
        with pytest.raises(ApiError, match="HTTP 404"):
            await loader.load(f"{url}/missing.wav")
        with pytest.raises(ApiError) as err:
            await ReferenceLoader(policy(allow_remote=True, max_bytes=4096, address_allowed=loopback_one)).load(
                f"{url}/ref.wav")
        assert err.value.status == 413


async def test_remote_urls_inside_the_servers_network_are_refused_alike_and_never_fetched(tmp_path):
    """Loopback, private, link-local and unroutable hosts are refused before any connection,
    all with the same message whether something listens there or not."""
    (tmp_path / "ref.wav").write_bytes(wav_bytes(2.0))
    loader = ReferenceLoader(policy(allow_remote=True))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
    with http_files(tmp_path) as (url, asked):
        messages = set()
        port = url.rsplit(":", 1)[1]
        for target in (f"{url}/ref.wav", f"http://127.0.0.1:{closed_port}/ref.wav", f"http://localhost:{port}/ref.wav",
                       "http://10.1.2.3/ref.wav", "http://192.168.0.1/ref.wav", "http://169.254.169.254/latest/meta-data",
                       "http://[::1]/ref.wav", "http://[::ffff:127.0.0.1]/ref.wav", "http://0.0.0.0/ref.wav",
                       "http://no-such-host.invalid/ref.wav"):
            with pytest.raises(ApiError) as err:
                await asyncio.wait_for(loader.load(target), 10)
            assert err.value.status == 400 and err.value.param == "ref_audio"
            messages.add(err.value.message)
        assert asked == []  # nothing was fetched
    assert len(messages) == 1 and "public" in messages.pop()


async def test_a_redirect_is_checked_like_the_first_url(tmp_path):
    (tmp_path / "ref.wav").write_bytes(wav_bytes(2.0))
    with http_files(tmp_path, host="127.0.0.2") as (inside, inside_asked):
        with http_files(tmp_path, redirects={"/away": f"{inside}/ref.wav", "/here": "/ref.wav"}) as (url, asked):
            loader = ReferenceLoader(policy(allow_remote=True, address_allowed=loopback_one))
            assert (await loader.load(f"{url}/here")).duration_s == pytest.approx(2.0)
            with pytest.raises(ApiError, match="could not be fetched"):
                await loader.load(f"{url}/away")
    assert asked == ["/here", "/ref.wav", "/away"] and inside_asked == []


async def test_a_trickling_server_is_given_one_deadline_in_all(tmp_path):
    """A server that sends a byte every 0.2 s never stalls a read, yet the fetch ends at
    api.remote_ref_timeout_s."""
    async def trickle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(500):
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.2)

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        loader = ReferenceLoader(policy(allow_remote=True, address_allowed=loopback_one, remote_timeout_s=1.0))
        with pytest.raises(ApiError, match="could not be fetched"):
            await asyncio.wait_for(loader.load(f"http://127.0.0.1:{port}/slow.wav"), 10)
    finally:
        server.close()


@pytest.mark.parametrize("address,public", [
    ("8.8.8.8", True), ("2001:4860:4860::8888", True),
    ("127.0.0.1", False), ("10.0.0.1", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("255.255.255.255", False), ("::1", False), ("fe80::1", False), ("fc00::1", False), ("::", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("ff02::1", False),
])
def test_public_addresses(address, public):
    import ipaddress

    from api.remote_fetch import public_address

    assert public_address(ipaddress.ip_address(address)) is public


@pytest.mark.parametrize("name", ["ok.wav\x00.txt", "file://{root}/ok.wav%00", "{root}/" + "n" * 300 + ".wav",
                                  "{root}/ok.wav/x", "{root}/loop.wav", "{root}/fifo.wav", "{root}/sub"])
async def test_local_paths_that_cannot_be_read_are_400s(tmp_path, name):
    """NUL bytes, over-long names, a file used as a directory, a symlink loop, a FIFO (refused
    without blocking on it) and a directory: each a 400 naming ref_audio."""
    import os

    (tmp_path / "ok.wav").write_bytes(wav_bytes(1.5))
    (tmp_path / "loop.wav").symlink_to(tmp_path / "loop.wav")
    os.mkfifo(tmp_path / "fifo.wav")
    (tmp_path / "sub").mkdir()
    locator = name.format(root=tmp_path)
    if not locator.startswith(("/", "file:")):
        locator = f"{tmp_path}/{locator}"
    with pytest.raises(ApiError) as err:
        await asyncio.wait_for(ReferenceLoader(policy(tmp_path)).load(locator), 10)
    assert (err.value.status, err.value.param) == (400, "ref_audio")


async def test_a_local_file_over_the_size_limit_is_refused_before_reading(tmp_path):
    (tmp_path / "big.wav").write_bytes(wav_bytes(1.5))
    with pytest.raises(ApiError) as err:
        await ReferenceLoader(policy(tmp_path, max_bytes=1024)).load(str(tmp_path / "big.wav"))
    assert err.value.status == 413


@pytest.mark.parametrize("listing", [
    b"ffconcat version 1.0\nfile ok.wav\n",
    b"#EXTM3U\n#EXT-X-TARGETDURATION:2\n#EXTINF:2,\nok.wav\n#EXT-X-ENDLIST\n",
    b"[playlist]\nFile1=ok.wav\nNumberOfEntries=1\n"])
async def test_files_that_name_other_files_are_refused(tmp_path, monkeypatch, listing):
    """Concat lists and playlists would make FFmpeg open a file relative to the working
    directory: they are refused, and the error does not depend on whether that file exists."""
    (tmp_path / "ok.wav").write_bytes(wav_bytes(1.5))
    monkeypatch.chdir(tmp_path)
    loader = ReferenceLoader(policy())
    with pytest.raises(ApiError) as present:
        await loader.load("data:audio/wav;base64," + base64.b64encode(listing).decode())
    (tmp_path / "ok.wav").unlink()
    with pytest.raises(ApiError) as absent:
        await loader.load("data:audio/wav;base64," + base64.b64encode(listing).decode())
    assert present.value.status == absent.value.status == 400
    assert present.value.message == absent.value.message


@pytest.mark.parametrize("fmt", ["ogg", "webm", "m4a"])
async def test_self_contained_containers_decode_through_ffmpeg(fmt):
    import av

    buf = io.BytesIO()
    codec = "aac" if fmt == "m4a" else "libopus"
    with av.open(buf, mode="w", format={"m4a": "ipod"}.get(fmt, fmt)) as container:
        stream = container.add_stream(codec, rate=48000)
        stream.layout = "mono"
        for i in range(100):  # 2 s
            frame = av.AudioFrame.from_ndarray(tone(0.02, 48000).T.copy(), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 48000, i * 960
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    ref = await ReferenceLoader(policy()).load(base64.b64encode(buf.getvalue()).decode())
    assert abs(ref.duration_s - 2.0) < 0.1


async def test_a_clip_sent_again_is_known_without_decoding_until_its_waveform_is_needed(monkeypatch):
    """Clients resend a voice's clip with every request: the loader knows identical bytes by
    their SHA-256 (same digest and duration, nothing decoded), and decodes them only when the
    codec waveform is asked for (a reference-cache miss), to the same waveform."""
    import api.reference as reference

    decoded = []
    decode = reference.decode_audio_bytes
    monkeypatch.setattr(reference, "decode_audio_bytes", lambda *a, **k: decoded.append(1) or decode(*a, **k))
    loader = ReferenceLoader(policy())
    locator = "data:audio/wav;base64," + base64.b64encode(wav_bytes(1.5)).decode()
    first = await loader.load(locator)
    assert len(decoded) == 1
    again = await loader.load(locator)
    assert len(decoded) == 1  # known: not decoded
    assert (again.digest, again.duration_s) == (first.digest, first.duration_s)
    np.testing.assert_array_equal(again.wav, first.wav)
    assert len(decoded) == 2  # ...until its waveform was needed
    other = await loader.load(base64.b64encode(wav_bytes(1.6)).decode())  # other bytes: decoded
    assert len(decoded) == 3 and other.digest != first.digest


async def test_an_inline_clip_sent_again_is_known_by_its_text_without_decoding_its_base64(monkeypatch):
    """A data: URL or bare base64 seen before is known by the text itself: neither its base64
    nor its audio is decoded again, and its waveform (a reference-cache miss) is still the same.
    The same bytes in other text (bare base64 of a clip first sent as a data: URL) are decoded
    again, to the same digest, and known by that text from then on."""
    import api.reference as reference

    b64 = []
    strict = reference._strict_base64
    monkeypatch.setattr(reference, "_strict_base64", lambda text: b64.append(1) or strict(text))
    audio = []
    decode = reference.decode_audio_bytes
    monkeypatch.setattr(reference, "decode_audio_bytes", lambda *a, **k: audio.append(1) or decode(*a, **k))
    loader = ReferenceLoader(policy())
    clip = base64.b64encode(wav_bytes(1.5)).decode()
    first = await loader.load("data:audio/wav;base64," + clip)
    assert (len(b64), len(audio)) == (1, 1)
    again = await loader.load("  data:audio/wav;base64," + clip + "\n")  # stripped: the same text
    assert (len(b64), len(audio)) == (1, 1)
    assert (again.digest, again.duration_s) == (first.digest, first.duration_s)
    np.testing.assert_array_equal(again.wav, first.wav)  # decoded only now, from the text
    assert (len(b64), len(audio)) == (2, 2)
    bare = await loader.load(clip)  # the same bytes, other text: decoded again
    assert (len(b64), len(audio), bare.digest) == (3, 3, first.digest)
    await loader.load(clip)  # and now known by this text too
    assert (len(b64), len(audio)) == (3, 3)


async def test_a_file_is_read_again_each_time_not_known_by_its_path(tmp_path):
    """A path names bytes that may change: the loader reads the file every time and knows it by
    what it holds, never by the path."""
    (tmp_path / "ref.wav").write_bytes(wav_bytes(1.5))
    loader = ReferenceLoader(policy(tmp_path))
    first = await loader.load(str(tmp_path / "ref.wav"))
    (tmp_path / "ref.wav").write_bytes(wav_bytes(2.5))
    second = await loader.load(str(tmp_path / "ref.wav"))
    assert second.digest != first.digest and second.duration_s == pytest.approx(2.5)


@pytest.mark.parametrize("payload", ["QUJD\nREVG" * 20, "QUJD REVG" * 20, "QUJDREVG=" * 20, "QUJDREVGé" * 20])
async def test_base64_with_whitespace_padding_inside_or_other_characters_is_refused(payload):
    """Inline base64 is strict: no line breaks or spaces, padding only at the end, ASCII only."""
    with pytest.raises(ApiError, match="invalid base64") as err:
        await ReferenceLoader(policy()).load("data:audio/wav;base64," + payload)
    assert err.value.status == 400


async def test_the_memo_forgets_the_least_recently_used_clip_and_never_keeps_a_refused_one():
    loader = ReferenceLoader(policy(), memo_size=2)
    clips = [base64.b64encode(wav_bytes(1.5 + 0.1 * i)).decode() for i in range(3)]
    for clip in clips:
        await loader.load(clip)
    assert loader.remembered == 2
    await loader.load(clips[0])  # forgotten, decoded again, remembered
    assert loader.remembered == 2
    short = base64.b64encode(wav_bytes(0.5)).decode()
    for _ in range(2):  # refused each time with the same error, never remembered
        with pytest.raises(ApiError, match="too short"):
            await loader.load(short)
    assert loader.remembered == 2


def silent_flac(seconds: float, channels: int, rate: int = 48000, *, hide_length: bool = False) -> bytes:
    """A FLAC of silence: minutes of many channels in a few hundred KB. ``hide_length`` zeroes
    the length its STREAMINFO header states (a legal "unknown"), so only decoding can tell."""
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros((int(seconds * rate), channels), np.int16), rate, format="FLAC",
                    subtype="PCM_16")
    data = bytearray(buf.getvalue())
    if hide_length:  # 36-bit total-samples field: the low 4 bits of byte 21 and bytes 22-25
        data[21] &= 0xF0
        data[22:26] = b"\0\0\0\0"
    return bytes(data)


def decode_peak(loader: ReferenceLoader, data: bytes) -> tuple[ApiError, int]:
    """The error decoding ``data`` ends in, and the most memory numpy held meanwhile (bytes)."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ApiError) as err:
            loader.prepare_bytes(data)
        return err.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_decompression_bomb_is_refused_from_its_header_before_decoding():
    """Ten minutes of 8-channel silence, 237 KB of FLAC (28.8M samples, 110 MB as float32 when
    whole): refused from the length its header states, with next to nothing decoded."""
    bomb = silent_flac(600, 8)
    assert len(bomb) < 300_000
    error, peak = decode_peak(ReferenceLoader(policy(max_bytes=1_000_000)), bomb)
    assert error.status == 400 and "too long (600.00 s)" in error.message and error.param == "ref_audio"
    assert peak < 4_000_000


def test_a_bomb_whose_header_states_no_length_stops_decoding_past_the_limit():
    """The same bomb with its length hidden is decoded in pieces, each cut to the codec's one
    channel, and decoding stops once past max_ref_seconds: the memory held stays near
    max_seconds of mono float32 (5.8 MB at 48 kHz), not the clip's 110 MB."""
    bomb = silent_flac(600, 8, hide_length=True)
    error, peak = decode_peak(ReferenceLoader(policy(max_bytes=1_000_000)), bomb)
    assert error.status == 400 and "too long (at least 30." in error.message
    assert peak < 16_000_000


@pytest.mark.parametrize("data,words", [
    (lambda: wav_bytes(1.5, channels=9), "9 channels; at most 8"),
    (lambda: wav_bytes(1.5, rate=384000), "384000 Hz; at most 192000"),
])
def test_a_clip_past_the_channel_or_rate_bound_is_refused_before_decoding(data, words):
    error, peak = decode_peak(ReferenceLoader(policy(max_bytes=10_000_000)), data())
    assert error.status == 400 and words in error.message and error.param == "ref_audio"
    assert peak < 1_000_000


def test_ffmpeg_decoding_stops_past_the_limit_too():
    """A clip only FFmpeg reads (mp3) past max_ref_seconds is refused, from its header or from
    what was decoded, without holding it all."""
    data = encoded_bytes("mp3", 40.0, rate=48000, channels=2)
    error, peak = decode_peak(ReferenceLoader(policy(max_bytes=10_000_000, max_seconds=5.0)), data)
    assert error.status == 400 and "too long (" in error.message
    assert peak < 8_000_000


def test_a_multichannel_clip_is_fixed_to_the_codec_channels_as_it_is_decoded():
    """Piece by piece (several pieces here), the codec's channel rule gives what it gives the
    whole clip: the mean for a mono codec, the first two channels for a stereo one."""
    from api.reference import decode_audio_bytes
    from api.reference_decode import PIECE_FRAMES

    frames = 2 * PIECE_FRAMES + 123
    samples = np.stack([np.full(frames, v, np.int16) for v in (1000, 3000, 5000, 7000)], axis=1)
    buf = io.BytesIO()
    soundfile.write(buf, samples, 48000, format="WAV", subtype="PCM_16")
    mono, _ = decode_audio_bytes(buf.getvalue(), policy())
    stereo, rate = decode_audio_bytes(buf.getvalue(), policy(channels=2))
    assert mono.shape == (1, frames) and stereo.shape == (2, frames) and rate == 48000
    np.testing.assert_allclose(mono[0], 4000 / 32768, rtol=1e-6)
    np.testing.assert_allclose(stereo[:, -1], [1000 / 32768, 3000 / 32768], rtol=1e-6)
