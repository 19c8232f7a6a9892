"""ElevenLabs' text-to-speech over HTTP, end to end: the official `elevenlabs` Python SDK (and
plain HTTP where the SDK hides what is checked) against a real `mossvox serve` on loopback (tiny
demo model, cpu profile, an API key).

Audio arrives in the layout `output_format` asks for (PCM at the rate asked, mp3 at its rate and
bit rate, μ-law), every ElevenLabs field is accepted and the unused ones are named in
X-Ignored-Fields, `xi-api-key` is the key, `voice_id` names a registered voice or a built-in one,
and errors come in ElevenLabs' shape. Random weights: the audio is noise; its length is forced
from the text (cpu profile), so lengths are exact.
"""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from elevenlabs import VoiceSettings
from elevenlabs.client import ElevenLabs
from elevenlabs.core.api_error import ApiError

from tests.api.audio_decode import decode_audio
from tests.api.helpers import FRAMES_PER_CHAR, FRAME_S, tone_wav, wait_idle
from tests.api.server_process import ServerProcess

KEY = "xi-test-4b1d"
TEXT = "Speak this sentence for the agent."
SECONDS = max(1, round(FRAMES_PER_CHAR * len(TEXT))) * FRAME_S


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-key", KEY).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"xi-api-key": KEY}) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(server):
    return ElevenLabs(api_key=KEY, base_url=server.url)


@pytest.mark.parametrize("fmt,rate", [("pcm_16000", 16000), ("pcm_22050", 22050), ("pcm_24000", 24000),
                                      ("pcm_44100", 44100)])
def test_the_sdk_gets_pcm_at_the_rate_it_asks_for(sdk, fmt, rate):
    audio = b"".join(sdk.text_to_speech.convert("default", text=TEXT, output_format=fmt))
    assert abs(len(audio) / 2 / rate - SECONDS) < 0.01  # mono s16le, exactly the forced length


def test_the_sdk_streams_mp3_at_its_rate_and_bit_rate(sdk):
    pieces = list(sdk.text_to_speech.stream("default", text=TEXT, output_format="mp3_44100_128",
                                            model_id="eleven_flash_v2_5"))
    assert len(pieces) > 1  # streamed, not one block
    audio = b"".join(pieces)
    pcm, rate = decode_audio(audio, "mp3")
    assert rate == 44100 and pcm.shape[1] == 1
    assert abs(pcm.shape[0] / rate - SECONDS) < 0.1
    assert 0.8 < len(audio) * 8 / SECONDS / 128_000 < 1.25


def test_ulaw_for_telephony_is_one_byte_a_sample_at_8_khz(sdk):
    audio = b"".join(sdk.text_to_speech.stream("default", text=TEXT, output_format="ulaw_8000"))
    assert abs(len(audio) / 8000 - SECONDS) < 0.01
    pcm, rate = decode_audio(audio, "ulaw", sample_rate=8000, channels=1)
    assert rate == 8000 and pcm.shape[0] == len(audio)


def test_with_timestamps_gives_the_audio_and_no_alignment(sdk):
    whole = sdk.text_to_speech.convert_with_timestamps("default", text=TEXT, output_format="pcm_24000")
    assert abs(len(base64.b64decode(whole.audio_base_64)) / 2 / 24000 - SECONDS) < 0.01
    assert whole.alignment is None and whole.normalized_alignment is None
    chunks = list(sdk.text_to_speech.stream_with_timestamps("default", text=TEXT, output_format="pcm_16000"))
    assert len(chunks) > 1 and all(c.alignment is None for c in chunks)
    audio = b"".join(base64.b64decode(c.audio_base_64) for c in chunks)
    assert abs(len(audio) / 2 / 16000 - SECONDS) < 0.01


def test_every_elevenlabs_field_is_taken_and_the_unused_ones_named(http, server):
    body = {"text": TEXT, "model_id": "eleven_multilingual_v2", "language_code": "en", "seed": 7,
            "voice_settings": {"stability": 0.4, "similarity_boost": 0.8, "style": 0.0,
                               "use_speaker_boost": True, "speed": 1.0},
            "previous_text": "Before.", "next_text": "After.", "apply_text_normalization": "auto",
            "pronunciation_dictionary_locators": [], "a_field_from_a_newer_api": 1}
    r = http.post("/v1/text-to-speech/default/stream", params={"output_format": "pcm_16000",
                                                               "optimize_streaming_latency": 3},
                  json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-audio-sample-rate"] == "16000" and r.headers["x-audio-channels"] == "1"
    ignored = r.headers["x-ignored-fields"].split(", ")
    assert ignored[0] == "model_id"
    assert set(ignored) == {"model_id", "previous_text", "next_text", "a_field_from_a_newer_api",
                            "optimize_streaming_latency", "voice_settings.stability",
                            "voice_settings.similarity_boost"}  # style 0 and speaker boost on: defaults
    served = http.get("/v1/models").json()["data"][0]["id"]
    r = http.post("/v1/text-to-speech/default", params={"output_format": "pcm_16000"},
                  json={"text": TEXT, "model_id": served, "seed": 7})
    assert r.status_code == 200 and "x-ignored-fields" not in r.headers
    assert abs(len(r.content) / 2 / 16000 - SECONDS) < 0.01


def test_voice_settings_speed_changes_the_length(http):
    r = http.post("/v1/text-to-speech/default", params={"output_format": "pcm_16000"},
                  json={"text": TEXT, "voice_settings": {"speed": 1.25}})
    assert r.status_code == 200
    assert abs(len(r.content) / 2 / 16000 - SECONDS / 1.25) < 0.05


def test_voice_id_names_a_registered_voice(http, sdk):
    r = http.post("/v1/audio/voices", files={"audio": ("v.wav", tone_wav(2.0), "audio/wav")},
                  data={"name": "agent-voice", "consent": "recorded with consent"})
    assert r.status_code == 200, r.text
    audio = b"".join(sdk.text_to_speech.convert("agent-voice", text=TEXT, output_format="pcm_16000"))
    assert abs(len(audio) / 2 / 16000 - SECONDS) < 0.01


@pytest.mark.parametrize("path,params,body,status,field", [
    ("/v1/text-to-speech/nobody-registered", {}, {"text": TEXT}, 404, "voice_not_found"),
    ("/v1/text-to-speech/default", {"output_format": "pcm_12345"}, {"text": TEXT}, 400, "invalid_output_format"),
    ("/v1/text-to-speech/default", {"output_format": "flac_44100"}, {"text": TEXT}, 400, "invalid_output_format"),
    ("/v1/text-to-speech/default", {}, {"text": "   "}, 400, None),
    ("/v1/text-to-speech/default", {}, {"text": TEXT, "voice_settings": {"speed": 9}}, 400, None),
])
def test_errors_come_in_elevenlabs_shape(http, path, params, body, status, field):
    r = http.post(path, params=params, json=body)
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert set(detail) == {"status", "message"} and detail["message"]
    if field is not None:
        assert detail["status"] == field


def test_a_body_that_fails_validation_is_a_422_naming_the_field(http):
    r = http.post("/v1/text-to-speech/default/stream", json={"text": 12})
    assert r.status_code == 422
    (problem,) = r.json()["detail"]
    assert problem["loc"] == ["body", "text"] and problem["msg"]
    assert http.post("/v1/text-to-speech/default", content=b"{not json").status_code == 422


def test_the_key_is_xi_api_key_and_a_wrong_one_is_a_401_in_their_shape(server, sdk):
    with pytest.raises(ApiError) as caught:
        b"".join(ElevenLabs(api_key="wrong", base_url=server.url).text_to_speech.convert("default", text=TEXT))
    assert caught.value.status_code == 401
    assert httpx.post(f"{server.url}/v1/text-to-speech/default", json={"text": TEXT}).json() == {
        "detail": {"status": "invalid_api_key",
                   "message": "Missing API key: send 'Authorization: Bearer <key>' or 'xi-api-key: <key>'"}}
    r = httpx.post(f"{server.url}/v1/audio/speech", headers={"xi-api-key": KEY},
                   json={"input": TEXT, "response_format": "pcm"})
    assert r.status_code == 200  # the same key works on the OpenAI routes, in either header
    assert "error" in httpx.post(f"{server.url}/v1/audio/speech", json={"input": TEXT}).json()


def test_a_client_leaving_mid_stream_frees_every_stage(server):
    long_text = "This sentence is long enough to keep the engine busy for a while. " * 3
    with httpx.Client(base_url=server.url, timeout=60, headers={"xi-api-key": KEY}) as client:
        with client.stream("POST", "/v1/text-to-speech/default/stream/with-timestamps",
                           params={"output_format": "pcm_16000"}, json={"text": long_text}) as r:
            line = next(r.iter_lines())
            assert json.loads(line)["audio_base64"]
    assert not any(wait_idle(server.url).values()), "every stage freed its state"
