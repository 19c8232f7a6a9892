"""`WS /v1/audio/speech/stream` against clients that misbehave, on a real server (tiny demo model,
Local-v1.5, cpu profile) over loopback: a message over the size limit, a session that goes
quiet, a client that vanishes mid-sentence, a client that stops reading, a session that queues
many utterances. Each is bounded (closed, dropped or held back), every stage's state is freed,
and the server goes on serving other sessions.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest
import websockets

from tests.api.helpers import FRAMES_PER_CHAR, metric
from tests.api.server_process import ServerProcess
from tests.api.stream_client import connect, next_event, read_utterance, send, speak, speak_queued, ws_url
from tests.api.helpers import engine_gauges

MAX_MESSAGE = 64 * 1024  # api.max_body_bytes here
IDLE_S, SEND_S = 2.0, 2.0
NATIVE = {"response_format": "pcm", "sample_rate": 48000, "channels": 2, "seed": 1}
BYTES_PER_FRAME = 3840 * 2 * 2  # 48 kHz stereo s16: 80 ms


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), sets=(
        f"api.max_body_bytes={MAX_MESSAGE}", f"stream.idle_timeout_s={IDLE_S}",
        f"stream.send_timeout_s={SEND_S}", "stream.max_session_chars=20000",
        "stream.max_segment_chars=2000")).start()
    yield s
    s.stop()


def wait_for(predicate, timeout: float = 30.0):
    """Poll `predicate()` until it returns something true (returned) or `timeout` passes (the
    last value returned)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def sessions_open(url: str) -> float:
    return metric(httpx.get(url + "/metrics").text, "mossvox_stream_sessions_open")


def all_freed(url: str) -> bool:
    """No session open and every engine gauge (running, queued, slots, ring bytes, client
    requests) back to zero."""
    return sessions_open(url) == 0 and not any(engine_gauges(url).values())


async def still_serving(url: str) -> None:
    async with connect(url) as ws:
        got = await speak(ws, ["Still serving every other client."], **NATIVE)
    assert got.done["total_sentences"] == 1 and len(got.audio) > 0


async def test_a_message_over_the_size_limit_closes_the_socket(server):
    async with connect(server.url) as ws:
        await send(ws, "session.config", **NATIVE)
        await send(ws, "input.text", text="x" * MAX_MESSAGE)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await next_event(ws, 30)
    assert closed.value.rcvd.code == 1009  # message too big
    assert wait_for(lambda: all_freed(server.url))
    await still_serving(server.url)


async def test_a_quiet_session_is_closed_after_the_idle_timeout(server):
    async with connect(server.url) as ws:
        await send(ws, "session.config", **NATIVE)
        await send(ws, "input.text", text="Half a sentence that nobody fini")
        started = time.monotonic()
        event = await next_event(ws, 30)
        waited = time.monotonic() - started
        assert event["type"] == "error" and event["error"]["code"] == "idle_timeout", event
        assert "stream.idle_timeout_s" in event["message"]
        with pytest.raises(websockets.ConnectionClosedOK):
            await next_event(ws, 30)
    assert IDLE_S - 0.2 <= waited < IDLE_S + 10
    assert wait_for(lambda: all_freed(server.url))


async def test_a_session_speaking_for_longer_than_the_idle_timeout_is_not_closed(server):
    text = "This one sentence takes a good while to speak from its start to its end."
    async with connect(server.url) as ws:
        await send(ws, "session.config", **NATIVE)
        await send(ws, "input.text", text=text)
        await send(ws, "input.done")
        got = await read_utterance(ws)  # the client sends nothing while it listens
    assert len(got.audio) == max(1, round(FRAMES_PER_CHAR * len(text))) * BYTES_PER_FRAME


async def test_a_client_gone_mid_sentence_frees_every_stage(server):
    long_text = "This sentence goes on and on " * 12 + "until it ends."
    before = httpx.get(server.url + "/metrics").text
    async with connect(server.url) as ws:
        await send(ws, "session.config", **NATIVE)
        await send(ws, "input.text", text=long_text)
        await send(ws, "input.done")
        await send(ws, "input.text", text="And text for the next one that")
        assert (await next_event(ws))["type"] == "audio.start"
        assert isinstance(await next_event(ws), bytes)
        assert engine_gauges(server.url)["running"] == 1
        ws.transport.abort()  # no close frame: the connection just drops
    assert wait_for(lambda: all_freed(server.url)), engine_gauges(server.url)
    after = httpx.get(server.url + "/metrics").text  # the sentence was aborted, not finished
    assert metric(after, "mossvox_engine_aborted_total") == metric(before, "mossvox_engine_aborted_total") + 1
    await still_serving(server.url)


async def test_a_client_that_stops_reading_is_dropped(server):
    """The client reads nothing: once the socket buffers (a few MB) are full the server's send
    stalls, and stream.send_timeout_s later the session is dropped and its request aborted,
    long before the utterance (~80 s of 48 kHz stereo, 16 MB) has been generated."""
    text = "A stalled reader never hears this long answer, however long it runs on. " * 16
    before = httpx.get(server.url + "/metrics").text
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    host, port = server.url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    async with websockets.connect(ws_url(server.url), sock=sock, max_size=None, max_queue=1) as ws:
        await send(ws, "session.config", **NATIVE, split_granularity="none")
        await send(ws, "input.text", text=text)
        await send(ws, "input.done")
        assert wait_for(lambda: engine_gauges(server.url)["running"] == 1, 10)
        assert wait_for(lambda: all_freed(server.url), 30), engine_gauges(server.url)
        after = httpx.get(server.url + "/metrics").text
        await still_serving(server.url)
        ws.transport.abort()
    assert metric(after, "mossvox_engine_aborted_total") == metric(before, "mossvox_engine_aborted_total") + 1
    assert metric(after, "mossvox_stream_utterances_total") == metric(before, "mossvox_stream_utterances_total")


async def test_one_session_holds_at_most_two_requests_however_many_utterances_it_queues(server):
    texts = [f"Utterance number {n} is one sentence long." for n in range(6)]
    got, seen = await speak_queued(server.url, texts, **NATIVE)
    assert [u.done["utterance_index"] for u in got] == list(range(6))
    assert [u.sentences[0].start["sentence_text"] for u in got] == texts
    assert max(seen) <= 2 and max(seen) >= 1, seen
