"""/v1/audio/speech end to end: real `mossvox serve` on loopback, official `openai` client.

The demo model's weights are random, so these tests check the plumbing (formats, rates,
channels, durations, streaming, determinism, errors), not speech quality. Durations are known
because the cpu profile forces each request's length from its text.
"""

from __future__ import annotations

import base64
import json
import time

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile

from tests.api.audio_decode import decode_audio
from tests.api.every_field import check_every_field
from tests.api.helpers import (FRAME_S, assert_error, data_url, expected_seconds, labelled, metric,
                               parse_sse, tone_wav)
from tests.api.server_process import ServerProcess

TEXT = "Streaming speech from mossvox."
FORMATS = ["mp3", "opus", "aac", "flac", "wav", "pcm"]
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
                 "wav": "audio/wav", "pcm": "audio/pcm"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    refs = tmp_path_factory.mktemp("refs")
    (refs / "ref.wav").write_bytes(tone_wav(2.0))
    s = ServerProcess(tmp_path_factory.mktemp("data"), sets=(
        "api.max_body_bytes=400000", "api.max_input_chars=300", f"api.allowed_local_paths=[{refs}]",
        "model.max_new_frames=600", "api.max_voices=2", "api.max_ref_bytes=300000")).start()
    s.refs = refs
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0)


@pytest.fixture(scope="module")
def rate_channels(http):
    card = http.get("/v1/models").json()["data"][0]
    return card["sample_rate"], card["channels"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_openai_client_gets_every_format(oai, rate_channels, fmt):
    response = oai.audio.speech.create(model="mossvox", voice="alloy", input=TEXT, response_format=fmt,
                                       extra_body={"seed": 1})
    headers = response.response.headers
    assert headers["content-type"] == CONTENT_TYPES[fmt]
    # pcm is OpenAI's 24 kHz mono; every other format is the model's own layout
    rate, channels = (24000, 1) if fmt == "pcm" else rate_channels
    assert (headers["x-audio-sample-rate"], headers["x-audio-channels"]) == (str(rate), str(channels))
    pcm, got_rate = decode_audio(response.content, fmt, sample_rate=rate, channels=channels)
    assert got_rate == rate  # 48 kHz: also what Opus decoders produce
    assert pcm.shape[1] == channels
    tolerance = 0.01 if fmt in ("pcm", "wav", "flac") else 0.12  # codec priming / padding
    assert abs(pcm.shape[0] / rate - expected_seconds(TEXT)) <= tolerance


LONG = {"input": "A request long enough that its first bytes arrive well before it ends.", "forced_frames": 120}


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "wav", "pcm"])
def test_default_response_streams_and_the_saved_file_decodes(oai, http, tmp_path, fmt):
    """No stream_format: the first bytes arrive while the engine still generates (as from OpenAI),
    and the file saved from the stream decodes with soundfile and PyAV at the declared layout."""
    saved = tmp_path / f"speech.{fmt}"
    with oai.audio.speech.with_streaming_response.create(
            model="mossvox", voice="alloy", input=LONG["input"], response_format=fmt,
            extra_body={"forced_frames": LONG["forced_frames"]}) as response:
        assert "content-length" not in response.headers  # chunked: the length is not known yet
        pieces = response.iter_bytes()
        first = next(pieces)
        assert first and metric(http.get("/metrics").text, "mossvox_engine_running") == 1
        saved.write_bytes(first + b"".join(pieces))
        rate, channels = int(response.headers["x-audio-sample-rate"]), int(response.headers["x-audio-channels"])
    assert (rate, channels) == ((24000, 1) if fmt == "pcm" else (48000, 2))
    seconds = LONG["forced_frames"] * FRAME_S
    if fmt != "aac":  # libsndfile has no AAC decoder
        raw = {"format": "RAW", "subtype": "PCM_16", "samplerate": rate, "channels": channels} if fmt == "pcm" else {}
        audio, sf_rate = soundfile.read(saved, always_2d=True, **raw)
        assert sf_rate == (48000 if fmt == "opus" else rate) and audio.shape[1] == channels
        assert abs(len(audio) / sf_rate - seconds) < 0.12
    options = {"format": "s16le", "options": {"sample_rate": str(rate), "ch_layout": "mono"}} if fmt == "pcm" else {}
    with av.open(str(saved), **options) as container:
        stream = container.streams.audio[0]
        assert stream.codec_context.sample_rate == rate and stream.codec_context.channels == channels
        samples = sum(frame.samples for frame in container.decode(stream))
    assert abs(samples / rate - seconds) < 0.12


def test_flac_is_sent_whole_unless_streamed_on_request(http, tmp_path):
    """A streamed FLAC cannot state its length (libsndfile then cannot read it whole), so flac
    comes whole by default, with its length in the header; streamed on request it still decodes."""
    r = http.post("/v1/audio/speech", json={**LONG, "response_format": "flac"})
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
    (tmp_path / "whole.flac").write_bytes(r.content)
    audio, rate = soundfile.read(tmp_path / "whole.flac", always_2d=True)
    assert rate == 48000 and audio.shape == (LONG["forced_frames"] * 3840, 2)
    with http.stream("POST", "/v1/audio/speech", json={**LONG, "response_format": "flac",
                                                        "stream_format": "audio"}) as streamed:
        pieces = streamed.iter_raw()
        first = next(pieces)
        assert first[:4] == b"fLaC" and metric(http.get("/metrics").text, "mossvox_engine_running") == 1
        body = first + b"".join(pieces)
    pcm, got_rate = decode_audio(body, "flac")
    assert got_rate == 48000 and pcm.shape == (LONG["forced_frames"] * 3840, 2)


def test_pcm_is_openais_layout_unless_the_native_one_is_asked(oai, rate_channels):
    rate, channels = rate_channels
    default = oai.audio.speech.create(model="mossvox", voice="alloy", input=TEXT, response_format="pcm")
    headers = default.response.headers
    assert (headers["x-audio-sample-rate"], headers["x-audio-channels"]) == ("24000", "1")
    assert len(default.content) == pytest.approx(expected_seconds(TEXT) * 24000 * 2, abs=2 * 480)
    native = oai.audio.speech.create(model="mossvox", voice="alloy", input=TEXT, response_format="pcm",
                                     extra_body={"sample_rate": rate, "channels": channels})
    headers = native.response.headers
    assert (headers["x-audio-sample-rate"], headers["x-audio-channels"]) == (str(rate), str(channels))
    assert len(native.content) == round(expected_seconds(TEXT) * rate) * channels * 2
    mono = oai.audio.speech.create(model="mossvox", voice="alloy", input=TEXT, response_format="pcm",
                                   extra_body={"sample_rate": rate})
    assert mono.response.headers["x-audio-channels"] == "1"
    assert len(mono.content) == round(expected_seconds(TEXT) * rate) * 2  # mono at the native rate


def test_whole_response_states_finish_reason_and_usage(http):
    r = http.post("/v1/audio/speech", json={"input": TEXT, "response_format": "wav", "stream": False})
    frames = round(expected_seconds(TEXT) / FRAME_S)
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
    assert r.headers["x-finish-reason"] == "stop"
    assert r.headers["x-output-tokens"] == str(frames) and r.headers["x-input-characters"] == str(len(TEXT))
    assert float(r.headers["x-audio-seconds"]) == pytest.approx(frames * FRAME_S, abs=1e-3)
    capped = http.post("/v1/audio/speech", json={"input": TEXT, "response_format": "pcm", "stream": False,
                                                 "forced_frames": 20, "max_new_tokens": 5})
    assert capped.headers["x-finish-reason"] == "length" and capped.headers["x-output-tokens"] == "5"
    events = parse_sse(http.post("/v1/audio/speech", json={"input": TEXT, "response_format": "pcm", "stream": True,
                                                           "forced_frames": 20, "max_new_tokens": 5}).content)
    assert events[-1][1]["finish_reason"] == "length" and events[-1][1]["usage"]["output_tokens"] == 5


def test_audio_seconds_are_counted_after_speed(http):
    """speed 2 halves the file, and the reported length with it (whole-file header and SSE usage)."""
    half = expected_seconds(TEXT) / 2
    whole = http.post("/v1/audio/speech", json={"input": TEXT, "response_format": "wav", "speed": 2.0,
                                                "stream": False})
    pcm, rate = decode_audio(whole.content, "wav")
    assert abs(pcm.shape[0] / rate - half) < 0.1
    assert float(whole.headers["x-audio-seconds"]) == pytest.approx(pcm.shape[0] / rate, abs=1e-3)
    events = parse_sse(http.post("/v1/audio/speech", json={"input": TEXT, "response_format": "pcm", "speed": 2.0,
                                                           "stream_format": "sse"}).content)
    audio = b"".join(base64.b64decode(data["audio"]) for name, data in events[:-1])
    assert events[-1][1]["usage"]["audio_seconds"] == pytest.approx(len(audio) / (2 * 24000), abs=1e-3)
    assert abs(events[-1][1]["usage"]["audio_seconds"] - half) < 0.1


def test_streamed_pcm_equals_whole_file_for_the_same_seed(oai, http):
    whole = oai.audio.speech.create(model="mossvox", voice="default", input=TEXT, response_format="pcm",
                                    extra_body={"seed": 7, "stream": False}).content
    chunks = []
    with oai.audio.speech.with_streaming_response.create(
            model="mossvox", voice="default", input=TEXT, response_format="pcm", stream_format="audio",
            extra_body={"seed": 7}) as response:
        assert response.headers["content-type"] == "audio/pcm"
        for chunk in response.iter_bytes():
            chunks.append(chunk)
    assert len(chunks) >= 2  # arrived in pieces (first chunk is one frame)
    assert b"".join(chunks) == whole
    other = oai.audio.speech.create(model="mossvox", voice="default", input=TEXT, response_format="pcm",
                                    extra_body={"seed": 8}).content
    assert other != whole


def test_concurrent_streams_each_get_their_own_audio(server, http, rate_channels):
    """Six streams at once (different texts and seeds) get what each produces alone.

    Batched codec decoding may round differently from a lone decode, so samples may differ by one
    int16 step; a mix-up between requests would differ everywhere."""
    import asyncio

    rate, channels = rate_channels  # the model's own samples, not mixed or resampled
    bodies = [{"input": f"Concurrent request number {i}.", "seed": 100 + i, "response_format": "pcm",
               "sample_rate": rate, "channels": channels, "stream": False} for i in range(6)]
    alone = [http.post("/v1/audio/speech", json=b).content for b in bodies]

    async def stream(client, body):
        async with client.stream("POST", "/v1/audio/speech", json={**body, "stream": None}) as r:
            return b"".join([piece async for piece in r.aiter_raw()])

    async def together():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(stream(client, b) for b in bodies))

    streamed = asyncio.run(together())
    for mine, solo in zip(streamed, alone):
        a, b = np.frombuffer(mine, "<i2").astype(np.int32), np.frombuffer(solo, "<i2").astype(np.int32)
        assert a.shape == b.shape and np.abs(a - b).max() <= 1
        assert np.mean(a != b) < 0.05


@pytest.mark.parametrize("fmt", ["mp3", "opus", "wav"])
def test_streaming_container_formats_decode(oai, rate_channels, fmt):
    rate, channels = rate_channels
    with oai.audio.speech.with_streaming_response.create(
            model="mossvox", voice="alloy", input=TEXT, response_format=fmt, stream_format="audio") as response:
        body = b"".join(response.iter_bytes())
    if fmt == "wav":
        assert body[4:8] == b"\xff\xff\xff\xff"  # streaming header: length unknown
    pcm, got_rate = decode_audio(body, fmt, sample_rate=rate, channels=channels)
    assert got_rate == rate and pcm.shape[1] == channels
    assert abs(pcm.shape[0] / rate - expected_seconds(TEXT)) <= 0.12


def test_sse_events_and_usage(http):
    rate, channels = 24000, 1  # pcm: OpenAI's layout
    for body in ({"input": TEXT, "response_format": "pcm", "stream": True},
                 {"input": TEXT, "response_format": "pcm", "stream_format": "sse"}):
        r = http.post("/v1/audio/speech", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(r.content)
        names = [name for name, _ in events]
        assert names[-1] == "speech.audio.done" and set(names[:-1]) == {"speech.audio.delta"}
        assert events[-1][1]["finish_reason"] == "stop"
        assert events[0][1]["sample_rate"] == rate and events[0][1]["channels"] == channels
        audio = b"".join(base64.b64decode(data["audio"]) for name, data in events[:-1])
        seconds = len(audio) / (2 * channels * rate)
        usage = events[-1][1]["usage"]
        assert usage["audio_seconds"] == pytest.approx(seconds, abs=1e-3)
        assert seconds == pytest.approx(expected_seconds(TEXT), abs=2e-3)
        assert usage["output_tokens"] == usage["output_frames"] == round(expected_seconds(TEXT) / FRAME_S)


def test_sse_carries_one_continuous_mp3(http, rate_channels):
    rate, channels = rate_channels
    r = http.post("/v1/audio/speech", json={"input": TEXT, "response_format": "mp3", "stream_format": "sse"})
    events = parse_sse(r.content)
    assert events[0][1]["response_format"] == "mp3" and events[-1][0] == "speech.audio.done"
    body = b"".join(base64.b64decode(data["audio"]) for name, data in events[:-1])
    pcm, got_rate = decode_audio(body, "mp3")
    assert got_rate == rate and pcm.shape[1] == channels
    assert abs(pcm.shape[0] / rate - expected_seconds(TEXT)) <= 0.12


@pytest.mark.parametrize("fmt,mode", [("wav", None), ("pcm", "audio"), ("pcm", "sse")])
def test_output_sample_rate_is_converted(http, rate_channels, fmt, mode):
    channels = 1 if fmt == "pcm" else rate_channels[1]  # pcm: OpenAI's mono unless asked
    body = {"input": TEXT, "response_format": fmt, "sample_rate": 16000}
    if mode:
        body["stream_format"] = mode
    r = http.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["x-audio-sample-rate"] == "16000"
    data = r.content
    if mode == "sse":
        events = parse_sse(data)
        assert events[0][1]["sample_rate"] == 16000
        data = b"".join(base64.b64decode(d["audio"]) for name, d in events[:-1])
    pcm, rate = decode_audio(data, fmt, sample_rate=16000, channels=channels)
    assert rate == 16000 and abs(pcm.shape[0] / rate - expected_seconds(TEXT)) < 0.01


def test_the_server_exports_its_event_loop_lag(http):
    """Each API process reports how late its loop ran a timer (`mossvox_api_loop_lag_seconds`)."""
    deadline = time.monotonic() + 5.0
    while metric(http.get("/metrics").text, "mossvox_api_loop_lag_seconds_count") == 0:
        assert time.monotonic() < deadline, "no loop lag observed in /metrics"
        time.sleep(0.05)


def test_reference_audio_forms_and_cache(http, server):
    before = http.get("/metrics").text
    ref = data_url(tone_wav(2.0, hz=330.0))
    first = http.post("/v1/audio/speech", json={"input": "Cloned voice.", "response_format": "pcm",
                                                "ref_audio": ref})
    assert first.status_code == 200 and first.headers["x-ref-cache"] == "miss"
    again = http.post("/v1/audio/speech", json={"input": "Cloned voice.", "response_format": "pcm",
                                                "ref_audio": ref.split(",", 1)[1], "ref_text": "a tone"})
    assert again.status_code == 200 and again.headers["x-ref-cache"] == "hit"
    local = http.post("/v1/audio/speech", json={"input": "Path.", "response_format": "pcm",
                                                "ref_audio": f"file://{server.refs}/ref.wav"})
    assert local.status_code == 200
    after = http.get("/metrics").text
    name = "mossvox_ref_cache_lookups_total"
    assert labelled(after, name, result="hit") - labelled(before, name, result="hit") == 1
    assert labelled(after, name, result="miss") - labelled(before, name, result="miss") == 2


def test_a_voice_heard_again_is_prefilled_from_the_talkers_cache(http):
    ref = data_url(tone_wav(3.0, hz=220.0))  # 37 reference frames: two full KV blocks and more
    body = {"input": "The same voice twice.", "response_format": "pcm", "ref_audio": ref, "seed": 11}

    def rows_after(previous: tuple[float, float] | None) -> tuple[float, float]:
        for _ in range(100):  # the talker reports its counters with its step statistics
            text = http.get("/metrics").text
            now = (metric(text, "mossvox_engine_talker_prompt_rows_total"),
                   metric(text, "mossvox_engine_talker_cached_rows_total"))
            if previous is None or now[0] > previous[0]:
                return now
            time.sleep(0.05)
        raise AssertionError("the talker's prompt rows were not counted")

    start = rows_after(None)
    first = http.post("/v1/audio/speech", json=body)
    middle = rows_after(start)
    second = http.post("/v1/audio/speech", json=body)
    end = rows_after(middle)
    assert first.status_code == second.status_code == 200
    assert second.content == first.content  # same seed, same audio, from cached blocks or not
    assert end[0] - middle[0] == middle[0] - start[0]  # the same prompt
    assert end[1] - middle[1] >= 32 and end[1] - middle[1] > middle[1] - start[1]


def test_long_mp3_reference_near_the_limit(http):
    """25 s of reference (9.6 MB once prepared as 48 kHz stereo float32) reaches the codec worker."""
    from api.audio_encoding import make_encoder

    t = np.arange(25 * 16000) / 16000
    encoder = make_encoder("mp3", 16000, 1, streaming=False)
    mp3 = encoder.encode((0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32)[:, None]) + encoder.finish()
    r = http.post("/v1/audio/speech", json={"input": "Long reference.", "response_format": "pcm",
                                            "ref_audio": "data:audio/mpeg;base64," + base64.b64encode(mp3).decode()})
    assert r.status_code == 200, r.text
    assert r.headers["x-ref-cache"] == "miss" and len(r.content) > 0


def test_voice_registry_round_trip(http, oai):
    wav = tone_wav(1.5, hz=440.0)
    r = http.post("/v1/audio/voices", data={"name": "tester", "consent": "recorded consent #1",
                                            "ref_text": "a test tone"},
                  files={"audio": ("ref.wav", wav, "audio/wav")})
    assert r.status_code == 200, r.text
    assert r.json()["voice"]["frames"] > 0
    listed = http.get("/v1/audio/voices").json()
    assert "tester" in listed["voices"]
    assert http.get("/v1/audio/voices/tester").json()["ref_text"] == "a test tone"
    spoken = oai.audio.speech.create(model="mossvox", voice="tester", input="With a voice.", response_format="wav")
    assert len(spoken.content) > 44
    by_object = http.post("/v1/audio/speech", json={"input": "Voice object.", "voice": {"id": "tester"},
                                                    "response_format": "pcm"})
    assert by_object.status_code == 200
    assert http.delete("/v1/audio/voices/tester").status_code == 200
    assert_error(http.get("/v1/audio/voices/tester"), 404)
    assert_error(http.delete("/v1/audio/voices/tester"), 404)
    assert_error(http.post("/v1/audio/speech", json={"input": "x", "voice": "tester"}), 404, param="voice")


def test_voice_upload_errors_and_cap(http):
    wav = tone_wav(1.5)

    def upload(name="v", consent="yes", audio=wav, **extra):
        files = {"audio": ("ref.wav", audio, "audio/wav")} if audio is not None else None
        data = {k: v for k, v in {"name": name, "consent": consent, **extra}.items() if v is not None}
        return http.post("/v1/audio/voices", data=data, files=files)

    assert_error(upload(consent=None), 400, param="consent")
    assert_error(upload(name="../etc"), 400, param="name")
    assert_error(upload(audio=None), 400, param="audio")
    assert_error(upload(audio=b"RIFF not really audio" * 50), 400, param="audio")
    assert_error(upload(audio=tone_wav(0.4)), 400, param="audio", contains="0.40 s")
    assert_error(upload(audio=tone_wav(10.0)), 413, contains="api.max_ref_bytes")
    assert_error(http.post("/v1/audio/voices", json={"name": "v"}), 400)
    for builtin in ("alloy", "Default", "NOVA"):  # would shadow the model's own voice
        assert_error(upload(name=builtin), 400, param="name", contains="built-in")
    assert_error(upload(name="v", overwrite="maybe"), 400, param="overwrite")
    try:
        assert upload(name="cap1").status_code == 200
        assert upload(name="cap2").status_code == 200
        assert_error(upload(name="cap3"), 400, param="name", contains="max_voices")
        assert_error(upload(name="cap1", ref_text="replaced"), 409, param="name", contains="overwrite")
        assert http.get("/v1/audio/voices/cap1").json()["ref_text"] is None  # the first one stays
        assert upload(name="cap1", ref_text="replaced", overwrite="true").status_code == 200  # not adding
        assert http.get("/v1/audio/voices/cap1").json()["ref_text"] == "replaced"
    finally:
        http.delete("/v1/audio/voices/cap1")
        http.delete("/v1/audio/voices/cap2")


@pytest.mark.parametrize("initial,frames", [(None, 1), (3, 3)])
def test_first_chunk_size_follows_initial_codec_chunk_frames(http, rate_channels, initial, frames):
    rate, channels = rate_channels
    body = {"input": TEXT, "response_format": "pcm", "stream_format": "sse", "sample_rate": rate,
            "channels": channels}
    if initial is not None:
        body["initial_codec_chunk_frames"] = initial
    events = parse_sse(http.post("/v1/audio/speech", json=body).content)
    first = base64.b64decode(events[0][1]["audio"])
    assert len(first) == frames * round(rate * FRAME_S) * channels * 2


@pytest.mark.parametrize("body,status,param,contains", [
    ({"input": ""}, 400, "input", "empty"),
    ({"input": "   "}, 400, "input", "empty"),
    ({"input": "x" * 301}, 400, "input", "300"),
    ({"input": "hi", "response_format": "ogg"}, 400, "response_format", "expected one of: aac, flac, mp3, opus, pcm, wav"),
    ({"input": "hi", "stream_format": "chunks"}, 400, "stream_format", "expected one of: audio, sse"),
    ({"input": "hi", "stream": False, "stream_format": "sse"}, 400, "stream_format", "'stream': false"),
    ({"input": "hi", "stream": False, "stream_format": "audio"}, 400, "stream_format", "'stream_format': 'audio'"),
    ({"input": "hi", "temperature": -1}, 400, "temperature", None),
    ({"input": "hi", "top_p": 1.5}, 400, "top_p", None),
    ({"input": "hi", "extra_params": {"top_k": -3}}, 400, "extra_params.top_k", None),
    ({"input": "hi", "speed": 9}, 400, "speed", None),
    ({"input": "hi", "sample_rate": 7000}, 400, "sample_rate", "7000"),
    ({"input": "hi", "bogus": 1}, 400, "bogus", "bogus"),
    ({"input": "hi", "ref_text": "no audio"}, 400, "ref_text", None),
    ({"input": "hi", "ref_audio": "definitely not audio"}, 400, "ref_audio", None),
    ({"input": "hi", "ref_audio": "file:///etc/passwd"}, 400, "ref_audio", "allowed"),
    ({"input": "hi", "ref_audio": "https://example.com/a.wav"}, 400, "ref_audio", "allow_remote"),
    ({"input": "hi", "model": "gpt-4o-tts-ultra"}, 404, "model", "gpt-4o-tts-ultra"),
    ({"input": "hi", "voice": "nobody"}, 404, "voice", "nobody"),
])
def test_error_statuses_and_envelope(http, body, status, param, contains):
    assert_error(http.post("/v1/audio/speech", json=body), status, param=param, contains=contains)


def test_local_v15_uses_every_optional_field_and_refuses_several_clips(http):
    check_every_field(http, {"input": TEXT}, ignored=())
    assert http.get("/v1/models").json()["data"][0]["root"] == "moss-tts-local-v1.5"
    clip = data_url(tone_wav(1.5))
    several = http.post("/v1/audio/speech", json={"input": "hi", "ref_audio": [clip, clip]})
    assert_error(several, 400, contains="one reference clip")  # wrong, not unused: not the first alone


def test_reference_duration_errors_name_the_measured_duration(http):
    short = http.post("/v1/audio/speech", json={"input": "hi", "ref_audio": data_url(tone_wav(0.5))})
    assert_error(short, 400, param="ref_audio", contains="0.50 s")
    long = http.post("/v1/audio/speech", json={"input": "hi", "ref_audio": data_url(tone_wav(31.0, rate=4000))})
    assert_error(long, 400, param="ref_audio", contains="31.00 s")


def test_malformed_and_oversized_bodies(http):
    assert_error(http.post("/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(http.post("/v1/audio/speech", json=["a list"]), 400)
    big = http.post("/v1/audio/speech", json={"input": "hi", "ref_audio": "A" * 500_000})
    assert_error(big, 413, contains="400000")


def test_openai_client_raises_typed_errors(oai):
    with pytest.raises(openai.BadRequestError):
        oai.audio.speech.create(model="mossvox", voice="alloy", input="")
    with pytest.raises(openai.NotFoundError):
        oai.audio.speech.create(model="no-such-model", voice="alloy", input="hi")


def test_service_routes(http):
    assert http.post("/v1/audio/speech", json={"input": "Metrics.", "response_format": "pcm",
                                               "stream_format": "audio"}).status_code == 200
    assert http.post("/v1/audio/speech", json={"input": ""}).status_code == 400
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").status_code == 200
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "mossvox"
    spec = http.get("/openapi.json").json()
    assert "SpeechRequest" in spec["components"]["schemas"] and "/v1/audio/speech" in spec["paths"]
    text = http.get("/metrics").text
    for name in ("mossvox_engine_running", "mossvox_engine_queued", "mossvox_engine_talker_slots",
                 "mossvox_engine_codec_slots", "mossvox_time_to_first_audio_seconds_count",
                 "mossvox_chunk_interval_seconds_count", "mossvox_real_time_factor_count",
                 "mossvox_audio_seconds_total", "mossvox_engine_decode_batch_sizes_count",
                 "mossvox_codec_coalesce_wait_seconds_count", "mossvox_engine_talker_batch_sizes_count"):
        metric(text, name)
    assert labelled(text, "mossvox_requests_total", outcome="ok") > 0
    assert labelled(text, "mossvox_requests_total", outcome="client_error") > 0
    helps = [line for line in text.splitlines() if line.startswith("# HELP mossvox_engine_")]
    assert len(helps) > 20
    for line in helps:  # every engine figure says what it measures, not just its key
        assert "engine counter" not in line.lower() and "engine distribution" not in line.lower(), line
    # this server sets no api.cors_origins: no CORS, a preflight is an unknown method
    preflight = http.options("/v1/audio/speech", headers={"Origin": "http://app.example",
                                                          "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers


def wait_engine_idle(http, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        text = http.get("/metrics").text
        values = {k: metric(text, f"mossvox_engine_{k}") for k in
                  ("running", "queued", "talker_slots", "codec_slots", "encode_jobs", "ring_bytes",
                   "client_open")}
        if not any(values.values()) or time.monotonic() > deadline:
            return values | {"aborted": metric(text, "mossvox_engine_aborted_total")}
        time.sleep(0.1)


@pytest.mark.parametrize("mode", ["audio", "sse"])
def test_disconnect_mid_stream_aborts_and_counters_return_to_zero(server, http, mode):
    aborted_before = wait_engine_idle(http)["aborted"]
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", "/v1/audio/speech", json={
                "input": "A long request that the client abandons.", "response_format": "pcm",
                "stream_format": mode, "forced_frames": 500}) as response:
            assert response.status_code == 200, response.read()
            pieces = response.iter_raw()  # keep it: dropping the iterator closes the connection
            first = next(pieces)
            assert first
            text = http.get("/metrics").text
            assert metric(text, "mossvox_engine_client_open") == 1  # still generating
            assert metric(text, "mossvox_engine_running") == 1
    idle = wait_engine_idle(http)
    assert {k: v for k, v in idle.items() if k != "aborted"} == dict.fromkeys(
        ("running", "queued", "talker_slots", "codec_slots", "encode_jobs", "ring_bytes", "client_open"), 0.0)
    assert idle["aborted"] == aborted_before + 1


def test_disconnect_during_a_whole_file_request_aborts_it(server, http):
    aborted_before = wait_engine_idle(http)["aborted"]
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=1.0)) as impatient:
        with pytest.raises(httpx.ReadTimeout):  # gives up and closes the connection
            impatient.post("/v1/audio/speech", json={"input": "Too long to wait for.", "response_format": "wav",
                                                     "forced_frames": 500, "stream": False})
    idle = wait_engine_idle(http)
    assert idle["running"] == idle["client_open"] == idle["talker_slots"] == idle["codec_slots"] == 0
    assert idle["aborted"] == aborted_before + 1


def test_fuzz_bodies_from_openapi_schema_never_5xx(http):
    schema = http.get("/openapi.json").json()["components"]["schemas"]
    rng = np.random.default_rng(1234)
    statuses = {}
    for i in range(250):
        body = fuzz_body(schema, rng)
        r = http.post("/v1/audio/speech", json=body)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (json.dumps(body), r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert_error(r, r.status_code)
    assert statuses.get(200, 0) > 10 and sum(v for k, v in statuses.items() if k >= 400) > 50, statuses


# --------------------------------------------------------------------------- schema-driven fuzzing

# Fields whose valid values cost generation time are drawn small (the schema allows 100 000).
CHEAP = {"max_new_tokens": [1, 2, 3], "forced_frames": [1, 2, 3]}
JUNK = [None, True, -1, 0, 1e308, -1e9, "", "x" * 50, [], {}, [1, "a"], {"id": 3}, "∞", "\x00"]


def fuzz_body(schemas: dict, rng) -> object:
    roll = rng.random()
    if roll < 0.03:
        return JUNK[rng.integers(len(JUNK))]
    spec = schemas["SpeechRequest"]
    body = {}
    for name, prop in spec["properties"].items():
        if name != "input" and rng.random() < 0.6:
            continue
        if name in CHEAP and rng.random() < 0.8:
            body[name] = CHEAP[name][rng.integers(3)]
        elif rng.random() < 0.8:
            body[name] = valid_value(prop, schemas, rng, name)
        else:
            body[name] = JUNK[rng.integers(len(JUNK))]
    if rng.random() < 0.05:
        body["unexpected_field"] = 1
    if rng.random() < 0.05:
        body.pop("input", None)
    return body


def valid_value(prop: dict, schemas: dict, rng, name: str):
    options = prop.get("anyOf", [prop])
    choice = options[rng.integers(len(options))]
    if "$ref" in choice:
        target = schemas[choice["$ref"].rsplit("/", 1)[1]]
        return {k: valid_value(v, schemas, rng, k) for k, v in target.get("properties", {}).items()
                if rng.random() < 0.5}
    if "enum" in choice:
        return choice["enum"][rng.integers(len(choice["enum"]))]
    kind = choice.get("type")
    if kind == "string":
        return "ab"[: rng.integers(0, 3)] if name == "input" else ["", "a", "default", "alloy", "xyz"][rng.integers(5)]
    if kind == "integer":
        lo, hi = choice.get("minimum", -5), min(choice.get("maximum", 1000), 1000)
        return int(rng.integers(lo, hi + 1))
    if kind == "number":
        lo = choice.get("minimum", choice.get("exclusiveMinimum", -2.0))
        hi = choice.get("maximum", choice.get("exclusiveMaximum", 4.0))
        return float(rng.uniform(lo, min(hi, 10.0)))
    if kind == "boolean":
        return bool(rng.integers(2))
    return None


def test_demo_page_plays_the_stream_and_its_controls_work_in_headless_chromium(server, tmp_path):
    """The page plays the PCM stream as it arrives, starts quiet, offers what it received as a
    download, and sends its format, speed and seed controls with the request."""
    from tests.api.cdp_pipe import Chromium, find_chromium

    binary = find_chromium()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium) - demo page not exercised")
    browser = Chromium(binary)

    def dataset() -> dict:
        return json.loads(browser.evaluate("JSON.stringify(document.body.dataset)"))

    def wait_for(states: tuple[str, ...], timeout_s: float = 30) -> dict:
        deadline = time.monotonic() + timeout_s
        while (state := dataset())["state"] not in states + ("error",) and time.monotonic() < deadline:
            time.sleep(0.1)
        return state

    def downloaded_bytes() -> int:
        return browser.evaluate("fetch(document.getElementById('download').href)"
                                ".then(r => r.arrayBuffer()).then(b => b.byteLength)", await_promise=True)

    try:
        browser.open_page(server.url + "/")
        deadline = time.monotonic() + 20
        while browser.evaluate("document.readyState") != "complete" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert float(dataset()["volume"]) <= 0.25  # the demo model's noise is full scale
        assert browser.evaluate("document.getElementById('download').getAttribute('aria-disabled')") == "true"
        browser.evaluate("document.getElementById('text').value = 'The demo page plays this as it arrives.'")
        browser.evaluate("document.getElementById('play').click()")
        state, played, clocks = {}, 0.0, []
        while time.monotonic() < deadline:
            state = dataset()
            clocks.append(float(state.get("clock", 0)))
            played = float(state.get("playedSeconds", 0))
            if state["state"] == "error" or float(state.get("playerTime", 0)) > 0.5:
                break
            time.sleep(0.1)
        (tmp_path / "demo.png").write_bytes(browser.screenshot())
        assert state["state"] != "error", state
        assert int(state["chunks"]) >= 1 and int(state["bytes"]) > 0
        assert played > 0 and clocks[-1] > clocks[0]  # the WebAudio clock advanced while it played
        assert float(state["playerTime"]) > 0  # and the page's <audio> element played the stream
        streamed = wait_for(("received", "done"))
        assert streamed["download"] == "speech.wav" and downloaded_bytes() == int(streamed["bytes"]) + 44

        text = "Twice as fast, in a file."
        browser.evaluate(f"document.getElementById('text').value = {json.dumps(text)}")
        browser.evaluate("document.getElementById('format').value = 'mp3'")
        browser.evaluate("document.getElementById('speed').value = '2'")
        browser.evaluate("document.getElementById('seed').value = '7'")
        browser.evaluate("document.getElementById('play').click()")
        done = wait_for(("done",))
        assert done["state"] == "done", done
        assert json.loads(done["request"]) == {"input": text, "response_format": "mp3", "speed": 2, "seed": 7,
                                               "stream": False}
        assert abs(float(done["audioSeconds"]) - expected_seconds(text) / 2) < 0.1
        assert done["download"] == "speech.mp3" and downloaded_bytes() == int(done["bytes"])
    finally:
        browser.close()
    png = (tmp_path / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
