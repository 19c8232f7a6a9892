"""Requests built to hurt the server, over HTTP on a real server: each is answered with a 4xx (or
served), and the server is still ready and serving afterwards. Ends with a fuzz pass driven by
``/openapi.json`` (no 5xx) and a look through the server's log for its API key."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.api.helpers import assert_error, data_url, tone_wav
from tests.api.server_process import ServerProcess

KEY = "sk-hostile-9f3a7c"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_FRAMES = 24  # model.max_new_frames here: every served request stays short
KV_BLOCKS = 64  # talker.kv_blocks here: 64 x 16 rows, so a long input outgrows the whole cache
CONCAT = b"ffconcat version 1.0\nfile ok.wav\n"


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("refs")
    (root / "ok.wav").write_bytes(tone_wav(1.5))
    (root / "loop.wav").symlink_to(root / "loop.wav")
    os.mkfifo(root / "fifo.wav")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, refs):
    # started in the refs directory: a concat list naming ok.wav would find it there
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-key", KEY, sets=(
        f"api.allowed_local_paths=[{refs}]", f"model.max_new_frames={MAX_FRAMES}",
        f"talker.kv_blocks={KV_BLOCKS}",
        "api.header_timeout_s=1", "api.body_timeout_s=1"), cwd=refs).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as client:
        yield client


def still_serving(http) -> None:
    assert http.get("/ready").status_code == 200
    r = http.post("/v1/audio/speech", json={"input": "Still here.", "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 0


@pytest.mark.parametrize("body,param,limit", [
    ({"input": "Hello.", "initial_codec_chunk_frames": 300, "forced_frames": 300},
     "initial_codec_chunk_frames", "ipc.pcm_ring_bytes"),
    ({"input": "x" * 403, "initial_codec_chunk_frames": 1000}, "initial_codec_chunk_frames", "ipc.pcm_ring_bytes"),
    ({"input": "Hello.", "forced_frames": MAX_FRAMES + 1}, "forced_frames", "model.max_new_frames"),
    ({"input": "Hello.", "max_new_tokens": MAX_FRAMES + 1}, "max_new_tokens", "model.max_new_frames"),
    ({"input": "Hello.", "top_k": 9223372036854775808}, "top_k", None),
    ({"input": "Hello.", "extra_params": {"top_k": 99999999999999999999}}, "extra_params.top_k", None),
])
def test_fields_past_the_engine_bounds_are_400s(http, body, param, limit):
    error = assert_error(http.post("/v1/audio/speech", json=body), 400, param=param)
    if limit is not None:
        assert limit in error["message"]
    still_serving(http)


def test_a_prompt_the_kv_cache_cannot_hold_is_a_400(http):
    """A request whose prompt plus its frames outgrows the talker's whole KV cache (64 blocks of 16
    rows here) is refused before it reaches the engine; one that fits is served."""
    assert_error(http.post("/v1/audio/speech", json={"input": "é" * 1500, "response_format": "pcm"}), 400,
                 contains="KV cache holds at most 1023 rows")
    r = http.post("/v1/audio/speech", json={"input": "é" * 300, "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 0
    still_serving(http)


def test_openapi_states_the_bounds(http):
    props = http.get("/openapi.json").json()["components"]["schemas"]["SpeechRequest"]["properties"]
    chunk = next(s for s in props["initial_codec_chunk_frames"]["anyOf"] if s["type"] == "integer")
    assert chunk["maximum"] == 273  # 48 kHz stereo float32 in the cpu profile's 16 MiB PCM ring
    assert next(s for s in props["forced_frames"]["anyOf"] if s["type"] == "integer")["maximum"] == MAX_FRAMES


def test_the_largest_first_chunk_allowed_is_served(http):
    r = http.post("/v1/audio/speech", json={"input": "Big first chunk.", "response_format": "pcm",
                                            "sample_rate": 48000, "channels": 2,  # the ring's own layout
                                            "initial_codec_chunk_frames": 273, "forced_frames": MAX_FRAMES})
    assert r.status_code == 200 and len(r.content) == MAX_FRAMES * 3840 * 2 * 2


@pytest.mark.parametrize("locator", ["{root}/ok.wav\u0000.txt", "file://{root}/ok.wav%00",
                                     "{root}/" + "n" * 300 + ".wav", "{root}/ok.wav/x", "{root}/loop.wav",
                                     "{root}/fifo.wav", "file://{root}/fifo.wav"])
def test_local_paths_that_cannot_be_read_are_400s(http, refs, locator):
    t0 = time.monotonic()
    r = http.post("/v1/audio/speech", json={"input": "Clone.", "ref_audio": locator.format(root=refs)})
    assert_error(r, 400, param="ref_audio")
    assert time.monotonic() - t0 < 5
    still_serving(http)


def test_an_allowed_local_file_is_served(http, refs):
    r = http.post("/v1/audio/speech", json={"input": "Clone.", "ref_audio": f"{refs}/ok.wav",
                                            "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 0


def test_concat_lists_are_refused_as_ref_audio_and_as_voices(http):
    r = http.post("/v1/audio/speech", json={"input": "Clone.",
                                            "ref_audio": "data:audio/wav;base64," + base64.b64encode(CONCAT).decode()})
    error = assert_error(r, 400, param="ref_audio")
    assert "ok.wav" not in error["message"]
    r = http.post("/v1/audio/voices", files={"audio": ("v.wav", CONCAT)}, data={"name": "sneaky", "consent": "yes"})
    assert_error(r, 400, param="audio")
    assert http.get("/v1/audio/voices/sneaky").status_code == 404
    still_serving(http)


@pytest.mark.parametrize("fields,param", [({"consent": "c" * 1001}, "consent"), ({"ref_text": "t" * 4097}, "ref_text")])
def test_voice_texts_are_bounded(http, fields, param):
    form = {"name": "long-texts", "consent": "yes", **fields}
    assert_error(http.post("/v1/audio/voices", files={"audio": ("v.wav", tone_wav(1.5))}, data=form), 400, param=param)
    r = http.post("/v1/audio/speech", json={"input": "Clone.", "ref_audio": data_url(tone_wav(1.5)),
                                            "ref_text": "t" * 4097})
    assert_error(r, 400, param="ref_text")


def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def test_a_connection_whose_headers_stall_is_closed(server, http):
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server, nothing answered
        assert time.monotonic() - t0 < 5
    still_serving(http)


def test_a_body_that_stalls_is_a_408_and_closed(server, http):
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"input\"")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408") and b"api.body_timeout_s" in reply
    still_serving(http)


def test_fuzz_from_the_openapi_document_never_gets_a_5xx(server):
    """Requests generated from the served ``/openapi.json``, valid ones and ones that break the
    schema, 80 of each for speech and 25 per other operation (a few hundred in all): none may be answered with a
    server error, and the server must stay ready."""
    api = schemathesis.openapi.from_url(server.url + "/openapi.json")
    for result in api.get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE]
        if operation.method.upper() == "POST":  # a body can break the schema; a path string cannot
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:

            @given(case=operation.as_strategy(mode))
            @settings(max_examples=80 if operation.path.endswith("/speech") else 25, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def call(case) -> None:
                response = case.call(base_url=server.url, headers=AUTH, timeout=60)
                assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])

            call()
            assert httpx.get(server.url + "/ready").status_code == 200, (operation.label, mode)


def test_the_api_key_is_never_logged(server, http):
    http.get("/metrics")
    log = "\n".join(server.log)
    assert "<redacted>" in log  # the profile dump is there, with the key masked
    assert KEY not in log


@pytest.mark.parametrize("key", [KEY, "sk-wrong-5e1d9b"])
def test_a_key_in_a_websocket_query_is_never_logged(server, key):
    """Browsers pass the key as ``?api_key=``; the server logs the socket's path, never the key
    (right or wrong)."""
    import websockets.sync.client

    url = server.url.replace("http://", "ws://") + f"/v1/audio/speech/stream?api_key={key}"
    with contextlib.suppress(websockets.exceptions.InvalidStatus):
        with websockets.sync.client.connect(url, open_timeout=10) as ws:
            ws.send(json.dumps({"type": "session.close"}))
            with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                while True:
                    ws.recv(timeout=10)
    time.sleep(0.2)
    log = "\n".join(server.log)
    assert "/v1/audio/speech/stream?api_key=<redacted>" in log  # the line is there, masked
    assert key not in log
