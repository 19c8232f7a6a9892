"""API keys, admission rejections, and engine failures mid-stream, on a real server.

The last test SIGKILLs an engine worker, so this module runs its own server.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import pytest
import websockets

from tests.api.helpers import assert_error, metric, parse_sse
from tests.api.server_process import ServerProcess

KEY = "sk-test-1"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-key", KEY, "--api-key", "sk-test-2", sets=(
        "admission.max_running=2", "admission.max_queued=0", "admission.retry_after_s=3",
        # the worker-death test waits out the restart: no second of backoff before it begins
        # (/ready is 503 while the new workers load either way)
        "engine.restart_backoff_s=0.05")).start()
    yield s
    s.stop()


@pytest.mark.parametrize("method,path", [("POST", "/v1/audio/speech"), ("GET", "/v1/models"),
                                         ("GET", "/v1/audio/voices"), ("DELETE", "/v1/audio/voices/x")])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}])
def test_v1_routes_need_a_key(http, method, path, headers):
    r = http.request(method, path, headers=headers, json={"input": "hi"} if method == "POST" else None)
    assert_error(r, 401)
    assert r.json()["error"]["type"] == "authentication_error"


def test_open_routes_and_both_keys(http):
    for path in ("/health", "/ready", "/metrics", "/openapi.json", "/"):
        assert http.get(path).status_code == 200, path
    for key in (KEY, "sk-test-2"):
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


async def test_the_speech_websocket_needs_a_key_too(server):
    from tests.api.stream_client import connect, next_event, send

    for headers, query in (({}, ""), ({"Authorization": "Bearer nope"}, ""), ({}, "?api_key=nope")):
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with connect(server.url, query=query, additional_headers=headers):
                pass
        assert refused.value.response.status_code == 403
    for headers, query in (({"Authorization": f"Bearer {KEY}"}, ""), ({}, "?api_key=sk-test-2")):
        async with connect(server.url, query=query, additional_headers=headers) as ws:
            await send(ws, "session.config", response_format="pcm")
            await send(ws, "input.done")
            assert await next_event(ws) == {"type": "session.done", "utterance_index": 0,
                                            "total_sentences": 0}


def test_openai_client_with_right_and_wrong_key(server):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert len(good.audio.speech.create(model="mossvox", voice="alloy", input="Key.", response_format="pcm").content) > 0
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.audio.speech.create(model="mossvox", voice="alloy", input="Key.")


def test_admission_rejection_is_429_with_retry_after(server, http):
    hold = {"input": "Holding a slot.", "response_format": "pcm", "stream_format": "audio", "forced_frames": 300}
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as a, \
            httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as b:
        with a.stream("POST", "/v1/audio/speech", json=hold) as held_a, \
                b.stream("POST", "/v1/audio/speech", json=hold) as held_b:
            assert held_a.status_code == held_b.status_code == 200
            pieces_a, pieces_b = held_a.iter_raw(), held_b.iter_raw()  # keep: dropping closes
            assert next(pieces_a) and next(pieces_b)
            r = http.post("/v1/audio/speech", headers=AUTH, json={"input": "Turned away.", "response_format": "pcm"})
            assert_error(r, 429, contains="queue full")
            assert int(r.headers["retry-after"]) >= 1
    deadline = time.monotonic() + 10
    while True:  # the held request was aborted by the disconnect; the slot frees
        r = http.post("/v1/audio/speech", headers=AUTH, json={"input": "Now it fits.", "response_format": "pcm"})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200 and len(r.content) > 0


def _worker_pid(server, stage: str) -> int:
    for line in server.log:
        match = re.search(rf"{stage} pid (\d+)", line)
        if match:
            return int(match.group(1))
    raise AssertionError(f"no {stage} pid in the server log")


def test_a_worker_death_fails_its_streams_visibly_and_the_server_recovers(server, http):
    """SIGKILL the codec worker while two streams run: SSE ends with an error event, the raw
    stream is cut (no clean end of the chunked body). The replica is restarted in place: /ready
    answers 503 meanwhile (and the ready gauge says 0), then 200 again by itself, requests are
    served, and /metrics counts the restart."""
    body = {"input": "This request outlives the codec worker.", "response_format": "pcm", "forced_frames": 400}
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as a, \
            httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as b:
        with a.stream("POST", "/v1/audio/speech", json={**body, "stream_format": "sse"}) as sse, \
                b.stream("POST", "/v1/audio/speech", json={**body, "stream_format": "audio"}) as raw:
            assert sse.status_code == raw.status_code == 200
            sse_pieces, raw_pieces = sse.iter_raw(), raw.iter_raw()
            received = next(sse_pieces)
            assert next(raw_pieces)
            os.kill(_worker_pid(server, "codec"), signal.SIGKILL)
            for piece in sse_pieces:
                received += piece
            with pytest.raises(httpx.RemoteProtocolError):
                for _ in raw_pieces:
                    pass
    events = parse_sse(received)
    assert events[0][0] == "speech.audio.delta"
    name, data = events[-1]
    assert name == "speech.audio.error"
    assert data["partial_audio"] is True and data["error"]["type"] == "server_error"
    deadline = time.monotonic() + 10  # the server's log reaches the test through a pipe
    while not any("failed after" in line for line in server.log):
        assert time.monotonic() < deadline, "the failure was not logged"
        time.sleep(0.05)
    deadline = time.monotonic() + 10
    while http.get("/ready").status_code != 503:
        assert time.monotonic() < deadline, "/ready never noticed the dead worker"
        time.sleep(0.05)
    assert metric(http.get("/metrics").text, "mossvox_engine_ready") == 0
    assert http.get("/health").status_code == 200  # restarting, not failed: no pod restart
    assert_error(http.post("/v1/audio/speech", headers=AUTH, json={"input": "During."}), 503)
    deadline = time.monotonic() + 120
    while http.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the server never became ready again"
        time.sleep(0.2)
    r = http.post("/v1/audio/speech", headers=AUTH, json={"input": "After the crash.", "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 0
    scrape = http.get("/metrics").text
    assert metric(scrape, "mossvox_engine_restarts_total") == 1
    assert metric(scrape, "mossvox_engine_ready") == 1 and metric(scrape, "mossvox_engine_healthy") == 1
