"""Attempts to exhaust a real server over loopback, each followed by a look at the server's state:
the API process's peak memory and descriptors, the limit counters of ``/metrics``, its log, and a
normal request still served. Every resource a client can make the server hold is bounded."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import base64
import contextlib
import io
import json
import os
import resource
import socket
import time

import httpx
import numpy as np
import psutil
import pytest
import soundfile

from tests.api.helpers import assert_error, data_url, labelled, metric, tone_wav
from tests.api.server_process import ServerProcess

MB = 1 << 20
PER_ADDRESS = 150  # api.max_connections_per_address here
PER_PROCESS = 300  # api.max_connections here
GAP_S, DEADLINE_S = 2, 4  # api.body_timeout_s and api.body_deadline_s here
SEND_TIMEOUT_S = 2  # api.send_timeout_s here
STREAM_BUFFER = 512 * 1024  # api.max_stream_buffer_bytes here
BATCH_OUTPUT = 4 * MB  # api.max_batch_output_bytes here
REF_CACHE = 64 * 1024  # api.ref_cache_max_bytes here


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), sets=(
        "model.max_new_frames=512", "api.header_timeout_s=30",
        f"api.body_timeout_s={GAP_S}", f"api.body_deadline_s={DEADLINE_S}",
        f"api.max_connections={PER_PROCESS}", f"api.max_connections_per_address={PER_ADDRESS}",
        f"api.send_timeout_s={SEND_TIMEOUT_S}", f"api.max_stream_buffer_bytes={STREAM_BUFFER}",
        f"api.max_batch_output_bytes={BATCH_OUTPUT}", "api.allow_remote_ref_audio=true",
        f"api.ref_cache_max_bytes={REF_CACHE}",
    )).start()
    yield s
    s.stop()


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def connect_from(server, source: str) -> socket.socket:
    """A connection from another loopback address (all of 127/8 is this host's)."""
    sock = socket.create_connection(address(server), timeout=10, source_address=(source, 0))
    return sock


def read_all(sock: socket.socket) -> bytes:
    reply = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def requests_by_outcome(http, outcome: str) -> float:
    return labelled(http.get("/metrics").text, "mossvox_requests_total", outcome=outcome)


def no_tracebacks(server) -> None:
    """Nothing a client did shows up as a traceback or an unexpected error in the server's log."""
    bad = [line for line in server.log if "Traceback" in line or "unexpected error" in line
           or "Exception in ASGI" in line]
    assert not bad, bad[:5]


def api_process(http) -> psutil.Process:
    """The API process (the server has one) and a normal request served by it."""
    r = http.post("/v1/audio/speech", json={"input": "Still serving.", "response_format": "pcm"})
    assert r.status_code == 200 and len(r.content) > 0
    return psutil.Process(int(r.headers["X-Api-Process"]))


def peak_rss(proc: psutil.Process) -> int:
    """The process's peak resident memory so far (VmHWM), bytes."""
    with open(f"/proc/{proc.pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def limit_hits(http, limit: str) -> float:
    return labelled(http.get("/metrics").text, "mossvox_limit_hits_total", limit=limit)


def silent_flac(seconds: float, channels: int, rate: int = 48000, *, hide_length: bool = False) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros((int(seconds * rate), channels), np.int16), rate, format="FLAC",
                    subtype="PCM_16")
    data = bytearray(buf.getvalue())
    if hide_length:  # STREAMINFO's 36-bit total-samples field zeroed: "unknown"
        data[21] &= 0xF0
        data[22:26] = b"\0\0\0\0"
    return bytes(data)


def test_a_decompression_bomb_as_ref_audio_is_refused_without_decoding_it(http):
    """Ten minutes of 8-channel silence in 237 KB of FLAC (110 MB of float32 samples when
    decoded whole), as stated in its header and with its length hidden: both 400s naming the
    duration limit, the API process's peak memory within a few MB of where it was."""
    proc = api_process(http)
    http.post("/v1/audio/speech", json={"input": "Warm the decoder.", "response_format": "pcm",
                                        "ref_audio": data_url(tone_wav(1.5))})
    before, hits = peak_rss(proc), limit_hits(http, "api.max_ref_seconds")
    for bomb in (silent_flac(600, 8), silent_flac(600, 8, hide_length=True)):
        assert len(bomb) < 300_000
        r = http.post("/v1/audio/speech", json={"input": "Clone this.",
                                                "ref_audio": base64.b64encode(bomb).decode()})
        assert_error(r, 400, param="ref_audio", contains="too long")
    assert peak_rss(proc) - before < 40 * MB
    assert limit_hits(http, "api.max_ref_seconds") == hits + 2
    assert api_process(http).pid == proc.pid


def test_a_body_that_trickles_past_the_deadline_is_a_408(server, http):
    """A byte every half second never stalls for api.body_timeout_s, yet the body is cut at
    api.body_deadline_s after its headers; the 408 names that field and is counted, not as a
    failure."""
    hits, failed = limit_hits(http, "api.body_deadline_s"), requests_by_outcome(http, "failed")
    with connect_from(server, "127.0.0.1") as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        started = time.monotonic()
        sock.settimeout(0.5)
        reply = b""
        while not reply and time.monotonic() - started < 30:
            with contextlib.suppress(TimeoutError):
                sock.sendall(b" ")
                reply = sock.recv(65536)
        sock.settimeout(10)
        reply += read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408") and b"api.body_deadline_s" in reply
    assert limit_hits(http, "api.body_deadline_s") == hits + 1
    assert requests_by_outcome(http, "failed") == failed
    no_tracebacks(server)


def test_a_client_that_leaves_mid_body_is_not_a_failure(server, http):
    failed, cancelled = requests_by_outcome(http, "failed"), requests_by_outcome(http, "cancelled")
    with connect_from(server, "127.0.0.1") as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"input\": ")
        time.sleep(0.3)
    for _ in range(50):
        if requests_by_outcome(http, "cancelled") == cancelled + 1:
            break
        time.sleep(0.1)
    assert requests_by_outcome(http, "cancelled") == cancelled + 1
    assert requests_by_outcome(http, "failed") == failed
    no_tracebacks(server)


def test_connections_past_the_caps_get_a_503_at_once_and_others_are_served(server, http):
    """One address holds at most api.max_connections_per_address; the next is answered 503 and
    closed before it sends anything, while another address is served. Past api.max_connections
    every address waits; closing them frees the places."""
    proc = api_process(http)
    fds = proc.num_fds()
    per_address = limit_hits(http, "api.max_connections_per_address")
    held = [connect_from(server, "127.0.0.2") for _ in range(PER_ADDRESS)]
    try:
        with connect_from(server, "127.0.0.2") as extra:
            reply = read_all(extra)
        assert reply.startswith(b"HTTP/1.1 503") and b"api.max_connections_per_address" in reply
        assert b"Retry-After: 1" in reply.replace(b"retry-after", b"Retry-After")
        assert limit_hits(http, "api.max_connections_per_address") == per_address + 1
        assert api_process(http).pid == proc.pid  # another address is served meanwhile
        assert proc.num_fds() <= fds + PER_ADDRESS + 8
        open_now = int(metric(http.get("/metrics").text, "mossvox_connections_open"))  # with http's own
        held += [connect_from(server, "127.0.0.3") for _ in range(PER_PROCESS - open_now)]
        assert http.get("/health").status_code == 200  # on its connection, admitted before
        with connect_from(server, "127.0.0.4") as extra:
            reply = read_all(extra)
        assert reply.startswith(b"HTTP/1.1 503") and b"(api.max_connections)" in reply
    finally:
        for sock in held:
            sock.close()
    for _ in range(50):
        if metric(http.get("/metrics").text, "mossvox_connections_open") <= 2:
            break
        time.sleep(0.1)
    assert metric(http.get("/metrics").text, "mossvox_connections_open") <= 2
    assert api_process(http).pid == proc.pid
    no_tracebacks(server)


SOAK_CONNECTIONS = 2000


async def slow_client(host: str, port: int, source: str) -> bytes:
    """A request whose body trickles a byte a second until the server answers; what it answered."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    try:
        writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{")
        reply = b""
        while True:
            try:
                data = await asyncio.wait_for(reader.read(65536), 1.0)
            except TimeoutError:
                writer.write(b" ")
                continue
            if not data:
                return reply
            reply += data
    except ConnectionError:
        return reply
    finally:
        writer.close()


def test_the_server_keeps_serving_through_2000_slow_connections(server, http):
    """2,000 clients on one address trickle request bodies: the first api.max_connections_per_address
    are held until api.body_deadline_s (408), the rest get a 503 at once; meanwhile health checks
    and speech from another address are served, the API process's descriptors stay bounded, and
    afterwards every place is given back with nothing in the log and no request counted failed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < SOAK_CONNECTIONS + 512:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, SOAK_CONNECTIONS + 1024), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < SOAK_CONNECTIONS + 512:
        pytest.skip("this process may not open enough descriptors for the soak")
    proc = api_process(http)
    fds = proc.num_fds()
    failed = requests_by_outcome(http, "failed")
    refused, cut = limit_hits(http, "api.max_connections_per_address"), limit_hits(http, "api.body_deadline_s")
    host, port = address(server)

    async def soak() -> list[bytes]:
        return await asyncio.gather(*(slow_client(host, port, "127.0.0.5") for _ in range(SOAK_CONNECTIONS)))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        attack = pool.submit(asyncio.run, soak())
        served = 0
        while not attack.done():
            assert http.get("/health").status_code == 200
            r = http.post("/v1/audio/speech", json={"input": "Served meanwhile.", "response_format": "pcm"})
            assert r.status_code == 200 and len(r.content) > 0
            assert proc.num_fds() <= fds + PER_ADDRESS + 16
            served += 1
        replies = attack.result()
    assert served >= 2
    statuses = collections.Counter(reply[:12] for reply in replies)
    assert statuses == {b"HTTP/1.1 408": PER_ADDRESS, b"HTTP/1.1 503": SOAK_CONNECTIONS - PER_ADDRESS}, statuses
    assert limit_hits(http, "api.max_connections_per_address") == refused + SOAK_CONNECTIONS - PER_ADDRESS
    assert limit_hits(http, "api.body_deadline_s") == cut + PER_ADDRESS
    assert requests_by_outcome(http, "failed") == failed
    for _ in range(50):
        if proc.num_fds() <= fds + 2:
            break
        time.sleep(0.1)
    assert proc.num_fds() <= fds + 2
    no_tracebacks(server)


def non_reader(server, body: dict) -> socket.socket:
    """A client that posts ``body`` and never reads: a small receive window, nothing taken."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address(server))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def held_audio(http) -> float:
    return metric(http.get("/metrics").text, "mossvox_held_audio_bytes")


def test_streams_nobody_reads_are_cut_and_hold_nothing_after(server, http):
    """16 clients ask for 48 kHz stereo streams of 512 frames (7.9 MB each, more than the
    kernel's socket buffers take) and read nothing: each response is cut once
    api.max_stream_buffer_bytes of it waits unsent, its connection dropped by the server and its
    engine request stopped; the API process's peak memory grows by little more than 16 of those
    buffers, and afterwards it holds no audio and serves as before."""
    proc = api_process(http)
    before, cuts = peak_rss(proc), limit_hits(http, "api.max_stream_buffer_bytes")
    cancelled = requests_by_outcome(http, "cancelled")
    body = {"input": "Nobody reads this.", "response_format": "pcm", "sample_rate": 48000,
            "channels": 2, "forced_frames": 512}
    socks = [non_reader(server, body) for _ in range(16)]
    try:
        wait_for(lambda: limit_hits(http, "api.max_stream_buffer_bytes") == cuts + 16)
        for sock in socks:  # dropped by the server: a reset, or the end after what the buffers took
            sock.settimeout(10)
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(1 << 20):
                    pass
        assert requests_by_outcome(http, "cancelled") == cancelled + 16
    finally:
        for sock in socks:
            sock.close()
    assert peak_rss(proc) - before < 16 * STREAM_BUFFER + 48 * MB  # unbounded: +115 MB, and held
    wait_for(lambda: held_audio(http) == 0)
    assert api_process(http).pid == proc.pid
    no_tracebacks(server)


def test_a_whole_file_past_the_stream_buffer_is_a_413(http):
    r = http.post("/v1/audio/speech", json={"input": "Too big to hold.", "response_format": "wav",
                                            "sample_rate": 48000, "channels": 2, "forced_frames": 64,
                                            "stream": False})
    assert_error(r, 413, contains="api.max_stream_buffer_bytes")
    assert held_audio(http) == 0


def test_a_small_batch_cannot_ask_for_unbounded_output(http):
    """The 635-byte batch that asked for 16 x 31 MB (512 frames each, slowed to a quarter, 48 kHz
    stereo wav): each item that would pass api.max_batch_output_bytes fails alone with a 413 (here
    all of them: each asks for more than the whole budget), the answer stays within the budget,
    and the API process's peak memory grows by a bounded amount; a batch within the budget is
    answered whole."""
    proc = api_process(http)
    before, hits = peak_rss(proc), limit_hits(http, "api.max_batch_output_bytes")
    batch = {"items": [{"input": f"Item {i}."} for i in range(16)], "forced_frames": 512, "speed": 0.25,
             "response_format": "wav", "sample_rate": 48000, "channels": 2}
    assert len(json.dumps(batch)) < 700
    r = http.post("/v1/audio/speech/batch", json=batch)
    assert r.status_code == 200
    results = r.json()["results"]
    failed = [item for item in results if item["status"] == "error"]
    assert failed and all(item["status_code"] == 413 and "api.max_batch_output_bytes" in item["error"]["message"]
                          for item in failed)
    assert len(r.content) < BATCH_OUTPUT * 4 / 3 + 64 * 1024
    assert limit_hits(http, "api.max_batch_output_bytes") == hits + len(failed)
    # at most each item's PCM from the engine (float32, 512 frames of 48 kHz stereo) and the
    # budget a few times over (files, base64, JSON); unbounded it was +1.45 GB
    assert peak_rss(proc) - before < 16 * 512 * 3840 * 2 * 4 + 4 * BATCH_OUTPUT + 32 * MB
    assert held_audio(http) == 0
    small = http.post("/v1/audio/speech/batch", json={"items": [{"input": "One."}, {"input": "Two."}],
                                                      "response_format": "pcm"})
    assert small.status_code == 200 and small.json()["succeeded"] == 2


def test_a_client_that_leaves_does_not_fail_another_waiting_on_the_same_clip(server, http):
    """A batch starts encoding a new reference and its client leaves; a speech request for the
    same clip, sent meanwhile, shares that encode: it is served every time, and nothing is
    counted failed."""
    failed = requests_by_outcome(http, "failed")
    for trial in range(5):
        clip = data_url(tone_wav(20.0, hz=180.0 + 7 * trial))
        body = json.dumps({"items": [{"input": "Leaving."}], "ref_audio": clip}).encode()
        with connect_from(server, "127.0.0.1") as leaver:
            leaver.sendall(b"POST /v1/audio/speech/batch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            with httpx.Client(base_url=server.url, timeout=60) as other:
                staying = concurrent.futures.ThreadPoolExecutor(1).submit(
                    other.post, "/v1/audio/speech", json={"input": "Staying.", "ref_audio": clip,
                                                          "response_format": "pcm"})
                time.sleep(0.05)
                leaver.close()
                r = staying.result()
        assert r.status_code == 200 and len(r.content) > 0, r.text[:300]
    assert requests_by_outcome(http, "failed") == failed
    no_tracebacks(server)


DEEP = "[" * 1000 + "]" * 1000
SURROGATE = "\\ud800"  # a lone UTF-16 surrogate, as JSON escapes it


@pytest.mark.parametrize("path,body,status", [
    ("/v1/audio/speech/batch", '{"items": ' + DEEP + "}", 400),
    ("/v1/audio/speech/batch", '{"items": [{"input": "x", "extra_params": ' + DEEP + "}]}", 400),
    ("/v1/audio/speech", '{"input": "x", "extra_params": {"top_k": ' + DEEP + "}}", 400),
    ("/v1/audio/speech", DEEP, 400),
    ("/v1/text-to-speech/default", '{"text": "x", "voice_settings": ' + DEEP + "}", 422),
] + [("/v1/audio/speech", '{"input": "x", "%s": "a%s"}' % (field, SURROGATE), 400)
     for field in ("input", "instructions", "language", "voice", "model")])
def test_hostile_json_is_a_client_error_and_the_connection_lives_on(server, http, path, body, status):
    """Nesting a thousand deep and lone surrogates get a 4xx in the error envelope: no 500, no
    reset keep-alive connection (the same connection serves the next request), no traceback."""
    fine = b'{"input": "Fine.", "response_format": "pcm"}'
    with connect_from(server, "127.0.0.1") as sock:
        for target, payload in ((path, body.encode()), ("/v1/audio/speech", fine)):
            sock.sendall(f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            head, reply = read_response(sock)
            if payload is fine:
                assert head.startswith(b"HTTP/1.1 200") and reply
            else:
                assert head.startswith(f"HTTP/1.1 {status}".encode()), head
                assert b"error" in reply or b"detail" in reply, reply
    no_tracebacks(server)


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP/1.1 response off a keep-alive connection: its head and its (dechunked) body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b"\0"
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])}
    if b"content-length" in lines:
        length = int(lines[b"content-length"])
        while len(rest) < length:
            rest += sock.recv(65536)
        return head, rest[:length]
    body = b""
    while True:
        while b"\r\n" not in rest:
            rest += sock.recv(65536)
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        while len(rest) < size + 2:
            rest += sock.recv(65536)
        body, rest = body + rest[:size], rest[size + 2:]
        if size == 0:
            return head, body


@pytest.mark.parametrize("message", [
    '{"type": "session.config", "instructions": ' + DEEP + "}",
    DEEP,
] + ['{"type": "session.config", "%s": "a%s"}' % (field, SURROGATE)
     for field in ("instructions", "language", "voice", "model")]
  + ['{"type": "input.text", "text": "a%s"}' % SURROGATE])
async def test_hostile_websocket_messages_get_an_error_frame_and_the_session_goes_on(server, message):
    from tests.api.stream_client import connect, next_event, read_utterance, send

    async with connect(server.url) as ws:
        await ws.send(message)
        event = await next_event(ws)
        assert event["type"] == "error" and event["error"]["type"] == "invalid_request_error", event
        await send(ws, "session.config", response_format="pcm")
        await send(ws, "input.text", text="Still speaking after that.")
        await send(ws, "input.done")
        utterance = await read_utterance(ws)
        assert utterance.audio
        await send(ws, "session.close")
    no_tracebacks(server)


async def test_a_hostile_elevenlabs_message_gets_an_error_and_no_traceback(server):
    import websockets

    url = server.url.replace("http://", "ws://") + "/v1/text-to-speech/default/stream-input?output_format=pcm_24000"
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send('{"text": "a%s"}' % SURROGATE)
        reply = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert "error" in json.dumps(reply).lower() or reply.get("message"), reply
    no_tracebacks(server)


@pytest.mark.parametrize("content_type,status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data; boundary=x", 415),
    (None, 200), ("application/json; charset=utf-8", 200), ("application/vnd.api+json", 200),
])
def test_only_json_reaches_the_json_routes(http, content_type, status):
    """What a page on another origin can send without asking first (text/plain, a form) is a 415
    that says how to send JSON; a body with no type, or any JSON type, is read."""
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps({"input": "Typed.", "response_format": "pcm"}).encode()
    for path in ("/v1/audio/speech", "/v1/audio/speech/batch"):
        payload = body if path.endswith("speech") else json.dumps({"items": [json.loads(body)]}).encode()
        r = http.post(path, content=payload, headers=headers)
        if status == 415:
            assert_error(r, 415, contains="application/json")
        else:
            assert r.status_code == 200, r.text[:300]


EVIL = "http://evil.example"


async def test_a_page_of_another_origin_cannot_open_the_websocket(server):
    """A browser names the page's origin on the handshake: another origin is refused (403) with
    no API key set; the server's own origin (its demo page) and clients that name none are let in."""
    import websockets
    from websockets.exceptions import InvalidStatus

    from tests.api.stream_client import ws_url

    with pytest.raises(InvalidStatus) as refused:
        async with websockets.connect(ws_url(server.url), origin=EVIL):
            pass
    assert refused.value.response.status_code == 403
    for origin in (server.url, None):
        async with websockets.connect(ws_url(server.url), origin=origin) as ws:
            await ws.send(json.dumps({"type": "input.text", "text": 5}))  # served: an error frame
            assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "error"


def test_a_page_of_another_origin_cannot_change_anything(http):
    """A voice upload (multipart, a form any page can post), a delete, a text/plain speech
    request: refused 403 from another origin, the registry untouched; the same from the server's
    own origin or with no origin goes through."""
    wav = tone_wav(1.5)
    form = {"name": "mine", "consent": "yes"}
    assert http.post("/v1/audio/voices", files={"audio": ("v.wav", wav)}, data=form).status_code == 200
    evil = {"Origin": EVIL}
    r = http.post("/v1/audio/voices", files={"audio": ("v.wav", tone_wav(2.5))},
                  data={**form, "overwrite": "true"}, headers=evil)
    assert_error(r, 403, contains="api.cors_origins")
    assert http.get("/v1/audio/voices/mine").json()["duration_s"] == pytest.approx(1.5)
    assert_error(http.delete("/v1/audio/voices/mine", headers=evil), 403)
    assert_error(http.post("/v1/audio/speech", content=b'{"input": "Hi."}',
                           headers={**evil, "Content-Type": "text/plain"}), 403)
    assert_error(http.post("/v1/audio/speech", json={"input": "Hi."}, headers=evil), 403)
    own = {"Origin": str(http.base_url).rstrip("/")}
    r = http.post("/v1/audio/speech", json={"input": "Same origin.", "response_format": "pcm"}, headers=own)
    assert r.status_code == 200 and r.content
    assert http.delete("/v1/audio/voices/mine", headers=own).status_code == 200


def test_remote_references_cannot_reach_inside_the_servers_network(http, tmp_path):
    """With remote references on, a URL on loopback (open port or closed), a private or a
    link-local address is refused before any connection, with one message for all."""
    from tests.api.test_reference import http_files

    (tmp_path / "ref.wav").write_bytes(tone_wav(1.5))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
    with http_files(tmp_path) as (url, asked):
        errors = set()
        for target in (f"{url}/ref.wav", f"http://127.0.0.1:{closed_port}/ref.wav", "http://10.0.0.7/ref.wav",
                       "http://169.254.169.254/latest/meta-data/"):
            r = http.post("/v1/audio/speech", json={"input": "Fetch this.", "ref_audio": target})
            errors.add(assert_error(r, 400, param="ref_audio")["message"])
        assert asked == []
    assert len(errors) == 1
    assert api_process(http)


def test_new_clips_without_end_keep_the_reference_cache_within_its_size(server, http):
    """Twenty new clips (two files each on disk): the cache's directories stay within
    api.ref_cache_max_bytes, the oldest files removed and counted; the newest clip is a hit."""
    from api.disk_budget import disk_bytes

    def cache_bytes() -> int:
        return sum(disk_bytes(os.path.join(folder, name)) for sub in ("ref_codes", "ref_clips")
                   for folder, _, names in os.walk(server.data_dir / sub) for name in names)

    evicted = metric(http.get("/metrics").text, "mossvox_ref_cache_evicted_files_total")
    for i in range(20):
        clip = data_url(tone_wav(1.2, hz=300.0 + 11 * i))
        r = http.post("/v1/audio/speech", json={"input": "New voice.", "ref_audio": clip, "response_format": "pcm"})
        assert r.status_code == 200 and r.headers["X-Ref-Cache"] == "miss"
    wait_for(lambda: cache_bytes() <= REF_CACHE)
    assert metric(http.get("/metrics").text, "mossvox_ref_cache_evicted_files_total") > evicted
    r = http.post("/v1/audio/speech", json={"input": "Again.", "ref_audio": clip, "response_format": "pcm"})
    assert r.status_code == 200 and r.headers["X-Ref-Cache"] == "hit"
