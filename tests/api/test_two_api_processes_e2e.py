"""`--api-servers 2`: two API processes on one port share the reference cache and the voice
registry (through the data directory), and both survive a restart of the whole server."""

from __future__ import annotations

import httpx
import pytest

from tests.api.helpers import data_url, labelled, tone_wav
from tests.api.server_process import ServerProcess

ATTEMPTS = 60  # new connections tried until the other process answers


def fresh_post(base: str, path: str, **kwargs) -> httpx.Response:
    """One request on a new connection (the kernel picks which API process accepts it)."""
    with httpx.Client(base_url=base, timeout=60) as client:
        return client.post(path, **kwargs)


def until_process(base: str, path: str, *, exclude: str, **kwargs) -> httpx.Response:
    for _ in range(ATTEMPTS):
        r = fresh_post(base, path, **kwargs)
        if exclude is None or r.headers.get("x-api-process") != exclude:
            return r
    raise AssertionError(f"every request landed on API process {exclude}")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shared-data")


@pytest.fixture(scope="module")
def server(data_dir):
    s = ServerProcess(data_dir, "--api-servers", "2").start()
    yield s
    s.stop()


def answering_processes(base: str, body: dict) -> tuple[set[str], int]:
    """Post `body` on new connections until both API processes have answered (at most ATTEMPTS);
    returns the processes seen and how many requests were sent. Which process accepts a connection
    is up to the kernel and the scheduler, so a fixed number of tries can land on one process."""
    pids: set[str] = set()
    sent = 0
    while len(pids) < 2 and sent < ATTEMPTS:
        r = fresh_post(base, "/v1/audio/speech", json=body)
        assert r.status_code == 200, r.text
        pids.add(r.headers["x-api-process"])
        sent += 1
    return pids, sent


def test_both_processes_serve_the_port(server):
    pids, _ = answering_processes(server.url, {"input": "Hi.", "response_format": "pcm"})
    assert len(pids) == 2


def test_reference_encoded_through_one_is_a_hit_on_the_other(server, data_dir):
    ref = data_url(tone_wav(2.0, hz=523.0))
    body = {"input": "Shared reference.", "response_format": "pcm", "ref_audio": ref}
    first = fresh_post(server.url, "/v1/audio/speech", json=body)
    assert first.status_code == 200 and first.headers["x-ref-cache"] == "miss"
    assert len([p for p in (data_dir / "ref_clips").rglob("*") if p.is_file()]) == 1  # the clip, validated
    other = until_process(server.url, "/v1/audio/speech", exclude=first.headers["x-api-process"], json=body)
    assert other.status_code == 200
    assert other.headers["x-ref-cache"] == "hit"  # from the shared directory, not this process's memory


def test_voice_uploaded_on_one_is_usable_on_the_other(server):
    upload = fresh_post(server.url, "/v1/audio/voices", data={"name": "shared", "consent": "yes"},
                        files={"audio": ("v.wav", tone_wav(1.5, hz=660.0), "audio/wav")})
    assert upload.status_code == 200, upload.text
    spoken = until_process(server.url, "/v1/audio/speech", exclude=upload.headers["x-api-process"],
                           json={"input": "Voice from the other process.", "voice": "shared", "response_format": "pcm"})
    assert spoken.status_code == 200 and len(spoken.content) > 0


def test_metrics_sum_over_both_processes(server):
    def ok_total() -> float:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            return labelled(client.get("/metrics").text, "mossvox_requests_total", outcome="ok")

    before = ok_total()
    pids, sent = answering_processes(server.url, {"input": "Count me.", "response_format": "pcm"})
    assert len(pids) == 2
    for _ in range(3):  # whichever process answers the scrape reports both processes' requests
        assert ok_total() == before + sent


def quiet_stop(log: list[str]) -> None:
    """A stop says what it stops and nothing from a library's exit (Triton's bindings count the
    objects still alive then: a heap left frozen out of collection printed dozens of lines)."""
    noise = [line for line in log if "nanobind" in line or "leaked" in line or "Traceback" in line]
    assert noise == [], noise[:5]


def test_everything_survives_a_restart(server, data_dir):
    assert server.stop() == 0
    quiet_stop(server.log)
    again = ServerProcess(data_dir, "--api-servers", "2").start()
    try:
        with httpx.Client(base_url=again.url, timeout=60) as client:
            assert "shared" in client.get("/v1/audio/voices").json()["voices"]
            r = client.post("/v1/audio/speech", json={"input": "After restart.", "voice": "shared",
                                                      "response_format": "pcm"})
            assert r.status_code == 200
            ref = data_url(tone_wav(2.0, hz=523.0))
            r = client.post("/v1/audio/speech", json={"input": "Cached.", "response_format": "pcm", "ref_audio": ref})
            assert r.status_code == 200 and r.headers["x-ref-cache"] == "hit"
    finally:
        assert again.stop() == 0
    quiet_stop(again.log)
