"""A real server with two replicas and two API processes (`engine.replicas: 2`, CPU, demo model).

SIGKILL of one replica's talker: `/ready` and `/health` stay 200, `/metrics` says one replica is
up, and new requests succeed (on the other replica). Then SIGTERM with `engine.shutdown: drain`:
a stream already running finishes whole before the server exits 0.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from tests.api.helpers import metric
from tests.api.server_process import ServerProcess

BODY = {"input": "Served by whichever replica has room.", "response_format": "pcm"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-servers", "2",
                      sets=("engine.replicas=2", "engine.shutdown=drain", "engine.restart_limit=0",
                            "engine.drain_timeout_s=60")).start()
    yield s
    s.stop()


def replica_pids(server, replica: int) -> dict[str, int]:
    for line in server.log:
        match = re.search(rf"replica {replica} ready: talker pid (\d+), codec pid (\d+)", line)
        if match:
            return {"talker": int(match.group(1)), "codec": int(match.group(2))}
    raise AssertionError(f"no pids of replica {replica} in the server log")


def speak(server, **extra) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=60) as client:  # a new connection each time
        return client.post("/v1/audio/speech", json={**BODY, **extra})


def engine_metric(server, name: str) -> float:
    return metric(httpx.get(f"{server.url}/metrics", timeout=10).text, f"mossvox_engine_{name}")


def test_ready_stays_200_when_one_replica_dies(server):
    assert all(speak(server).status_code == 200 for _ in range(2))
    assert engine_metric(server, "replicas_up") == 2
    os.kill(replica_pids(server, 1)["talker"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while engine_metric(server, "replicas_up") != 1:
        assert time.monotonic() < deadline, "replicas_up never dropped to 1"
        time.sleep(0.1)
    for _ in range(5):
        assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 200
        assert httpx.get(f"{server.url}/health", timeout=5).json() == {"status": "ok"}
    before = engine_metric(server, "replica0_dispatched")
    for _ in range(4):
        r = speak(server)
        assert r.status_code == 200 and len(r.content) > 0
    assert engine_metric(server, "replica0_dispatched") == before + 4
    assert engine_metric(server, "replica1_up") == 0


def test_sigterm_drains_a_running_stream(server):
    frames = 500  # streams for longer than the 5 s an API process had before the drain budget
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/audio/speech",
                           json={**BODY, "stream_format": "audio", "forced_frames": frames}) as r:
            assert r.status_code == 200
            rate = int(r.headers["x-audio-sample-rate"])
            channels = int(r.headers["x-audio-channels"])
            pieces = r.iter_raw()
            received = len(next(pieces))
            server.proc.send_signal(signal.SIGTERM)
            received += sum(len(piece) for piece in pieces)
    assert received == round(frames / 12.5 * rate) * channels * 2
    assert server.proc.wait(60) == 0
