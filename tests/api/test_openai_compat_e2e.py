"""What an OpenAI speech client, a batch client and a browser page on another origin meet: model
aliases and ``GET /v1/models/{id}``, ``POST /v1/audio/speech/batch``, CORS, and the logs a clean
shutdown leaves. One real `mossvox serve` on loopback (tiny demo model, cpu profile), with an
API key so that preflights are seen to pass before the key check."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest

from tests.api.audio_decode import decode_audio
from tests.api.helpers import FRAME_S, assert_error, expected_seconds, metric
from tests.api.server_process import ServerProcess

KEY = "compat-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
APP = "http://app.example"
ALIASES = ["tts-1", "tts-1-hd", "gpt-4o-mini-tts"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-key", KEY, sets=(
        f"api.cors_origins=[{APP}]", "api.max_batch_items=4")).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as client:
        yield client


def test_openai_model_names_are_aliases_of_the_served_model(oai, http):
    listed = [model.id for model in oai.models.list()]
    assert listed[0] == "mossvox" and listed[-3:] == ALIASES  # the served name first, then the rest
    for name in listed:
        assert oai.models.retrieve(name).id == name
        speech = oai.audio.speech.create(model=name, voice="alloy", input="Alias.", response_format="pcm")
        assert len(speech.content) == pytest.approx(expected_seconds("Alias.") * 24000 * 2, abs=2 * 480)
    with pytest.raises(openai.NotFoundError) as missing:
        oai.models.retrieve("gpt-4o-tts-ultra")
    error = assert_error(http.post("/v1/audio/speech", json={"input": "hi", "model": "gpt-4o-tts-ultra"}),
                         404, param="model")
    for name in listed:  # the 404s name what is served, as the list does
        assert name in error["message"] and name in str(missing.value)


def test_a_batch_answers_every_item_in_order(http):
    """Three items, the second invalid: two files and one error in the OpenAI envelope; the
    items run together through the engine (the talker steps them in one batch)."""
    steps_before = _talker_steps_of_two_or_more(http)
    r = http.post("/v1/audio/speech/batch", json={
        "response_format": "wav", "forced_frames": 30,  # defaults for every item
        "items": [{"input": "The first item."}, {"input": "", "seed": 3},
                  {"input": "The third item.", "response_format": "pcm", "forced_frames": 20}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "speech.batch" and body["id"].startswith("speech-batch-")
    assert (body["total"], body["succeeded"], body["failed"]) == (3, 2, 1)
    first, second, third = body["results"]
    assert [first["index"], second["index"], third["index"]] == [0, 1, 2]
    assert second["status"] == "error" and second["status_code"] == 400
    assert set(second["error"]) == {"message", "type", "param", "code"} and second["error"]["param"] == "input"
    assert "audio_data" not in second
    for item, fmt, frames, layout in ((first, "wav", 30, (48000, 2)), (third, "pcm", 20, (24000, 1))):
        assert item["status"] == "success" and item["response_format"] == fmt and item["finish_reason"] == "stop"
        assert (item["sample_rate"], item["channels"]) == layout
        assert item["media_type"] == ("audio/wav" if fmt == "wav" else "audio/pcm")
        pcm, rate = decode_audio(base64.b64decode(item["audio_data"]), fmt, sample_rate=layout[0],
                                 channels=layout[1])
        assert rate == layout[0] and pcm.shape[1] == layout[1]
        assert pcm.shape[0] / rate == pytest.approx(frames * FRAME_S, abs=2e-3)
        assert item["usage"]["output_tokens"] == frames
        assert item["usage"]["audio_seconds"] == pytest.approx(frames * FRAME_S, abs=2e-3)
    assert _talker_steps_of_two_or_more(http) > steps_before


def _talker_steps_of_two_or_more(http) -> float:
    """Talker steps that carried two requests or more so far (from the batch-size histogram)."""
    text = http.get("/metrics").text
    total = metric(text, "mossvox_engine_talker_batch_sizes_count")
    lone = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('mossvox_engine_talker_batch_sizes_bucket{le="1"'))
    return total - lone


@pytest.mark.parametrize("body,param,contains", [
    ({"items": []}, "items", "1 to 4"),
    ({"items": [{"input": "x"}] * 5}, "items", "api.max_batch_items"),
    ({"items": "not a list"}, "items", None),
    ({"input": "x"}, "items", None),
    ({"items": ["text"]}, "items[0]", None),
    ({"items": [{"input": "x"}], "speed": 9}, "speed", None),
    ({"items": [{"input": "x"}], "bogus": 1}, "bogus", None),
    ({"items": [{"input": "x"}], "stream_format": "sse"}, "stream_format", "whole"),
])
def test_a_body_that_is_not_a_batch_is_a_400(http, body, param, contains):
    assert_error(http.post("/v1/audio/speech/batch", json=body), 400, param=param, contains=contains)


def test_an_item_that_asks_to_stream_fails_alone(http):
    r = http.post("/v1/audio/speech/batch", json={"items": [{"input": "Whole.", "response_format": "pcm"},
                                                            {"input": "Streamed?", "stream": True}]})
    ok, refused = r.json()["results"]
    assert ok["status"] == "success" and refused["status_code"] == 400 and refused["error"]["param"] == "stream"


def test_cors_preflight_from_an_allowed_origin_passes_before_the_key_check(server):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:  # browsers send no key with it
        allowed = anonymous.options("/v1/audio/speech", headers={"Origin": APP, **preflight})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == APP
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        other = anonymous.options("/v1/audio/speech", headers={"Origin": "http://other.example", **preflight})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        refused = anonymous.post("/v1/audio/speech", json={"input": "No key."}, headers={"Origin": APP})
        assert refused.status_code == 401


def test_cors_responses_let_the_page_read_the_audio_layout(http):
    r = http.post("/v1/audio/speech", json={"input": "Cross origin.", "response_format": "pcm"},
                  headers={"Origin": APP})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
    exposed = r.headers["access-control-expose-headers"].lower()
    assert "x-audio-sample-rate" in exposed and "x-audio-channels" in exposed
    other = http.post("/v1/audio/speech", json={"input": "Elsewhere.", "response_format": "pcm"},
                      headers={"Origin": "http://other.example"})  # an origin not listed: kept out
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


def test_failed_requests_are_logged_with_their_reason(http, server):
    assert_error(http.post("/v1/audio/speech", json={"input": " "}), 400)
    assert any("client_error" in line and "Input text cannot be empty" in line for line in server.log)


def test_a_clean_shutdown_warns_of_nothing(server):
    """Runs last: it stops the module's server. Clients closing with nothing open are no news."""
    assert server.stop() == 0
    assert not [line for line in server.log if "went away" in line], server.log[-20:]
