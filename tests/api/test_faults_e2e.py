"""Faults under load on a real server (tiny CPU model): SIGKILL of the codec, of the talker and of
an API process, and SIGSTOP of a worker, while closed-loop clients stream raw and SSE responses.

For each fault: only the dead process is replaced (its peers keep their pids), the server is
ready again within a bound, every request a client made either finished, was refused with a 503
in the OpenAI envelope and `Retry-After` before any audio, ended its SSE stream with an error
event, or (raw audio) had its chunked body cut; a connection lost is accepted only with the API
process that held it. Never a 500, never a traceback in the server's log, and the server serves
afterwards. Last, SIGKILL of the whole server leaves its shared-memory segments and metrics folder
behind, and the next server's start sweeps them.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from ipc.shm import list_segments
from tests.api.helpers import metric, parse_sse
from tests.api.server_process import ServerProcess

DOWNTIME_BOUND_S = 60.0  # back in service after a worker's death (CPU, two shared cores)
SETS = ("engine.restart_backoff_s=0.05", "engine.liveness_timeout_s=3", "api.api_servers=2",
        "admission.request_timeout_s=60")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), sets=SETS).start()
    yield s
    s.stop()


@dataclass
class Outcome:
    kind: str         # "raw" | "sse"
    started: float
    ended: float
    result: str       # ok | refused | sse_error | cut | connection_lost | other:...
    detail: str = ""


@dataclass
class Load:
    """Closed-loop streaming clients, each one request after another on a fresh connection."""

    url: str
    clients: int = 3
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=("sse" if i % 2 else "raw",), daemon=True)
                         for i in range(self.clients)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        assert not any(t.is_alive() for t in self._threads), "a client hung"

    def _run(self, kind: str) -> None:
        while not self._stop.is_set():
            self.outcomes.append(one_request(self.url, kind))

    def wait_for_audio(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(o.result == "ok" for o in self.outcomes):
            assert time.monotonic() < deadline, "no request finished under load"
            time.sleep(0.05)


def one_request(url: str, kind: str) -> Outcome:
    body = {"input": "A request under load while a process dies.", "response_format": "pcm",
            "forced_frames": 40, "stream_format": "sse" if kind == "sse" else "audio"}
    t0 = time.monotonic()
    result, detail = "ok", ""
    try:
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=60) as r:
            if r.status_code != 200:
                r.read()
                error = r.json().get("error", {})
                if r.status_code == 503 and r.headers.get("retry-after") and set(error) == {
                        "message", "type", "param", "code"}:
                    result, detail = "refused", error["message"]
                else:
                    result, detail = f"other:{r.status_code}", r.text[:300]
            else:
                data = b"".join(r.iter_raw())
                if kind == "sse":
                    events = parse_sse(data)
                    last, payload = events[-1]
                    if last == "speech.audio.error":
                        result, detail = "sse_error", str(payload["error"])
                        if payload["error"]["code"] != 503:
                            result = f"other:sse code {payload['error']['code']}"
                    elif last != "speech.audio.done":
                        result = f"other:last event {last}"
    except httpx.RemoteProtocolError as exc:  # the body stopped before its end: cut
        result, detail = "cut", str(exc)
    except (httpx.ConnectError, httpx.ReadError, httpx.WriteError) as exc:
        result, detail = "connection_lost", str(exc)
    except Exception as exc:  # noqa: BLE001 - reported as what the client saw
        result, detail = f"other:{type(exc).__name__}", str(exc)
    return Outcome(kind, t0, time.monotonic(), result, detail)


def current_pid(server: ServerProcess, pattern: str) -> int:
    """The pid in the last log line matching `pattern` (one group) whose process is alive."""
    for line in reversed(server.log):
        m = re.search(pattern, line)
        if m and psutil.pid_exists(int(m.group(1))):
            return int(m.group(1))
    raise AssertionError(f"no live pid for {pattern!r} in the log")


def worker_pid(server: ServerProcess, stage: str) -> int:
    return current_pid(server, rf"\b{stage}0\[(\d+)\]")


def api_pids(server: ServerProcess) -> set[int]:
    pids = {int(m.group(1)) for line in server.log for m in [re.search(r"Started server process \[(\d+)\]", line)] if m}
    return {pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}


def wait_until(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout:g} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def check_outcomes(outcomes: list[Outcome], *, connections_may_drop: bool) -> None:
    allowed = {"ok", "refused", "sse_error", "cut"} | ({"connection_lost"} if connections_may_drop else set())
    bad = [o for o in outcomes if o.result not in allowed]
    assert not bad, bad
    if not connections_may_drop:  # a dead API process cannot send its SSE streams an error event
        assert not any(o.kind == "sse" and o.result == "cut" for o in outcomes), \
            "an SSE stream was cut without an error event"


def check_log(server: ServerProcess) -> None:
    text = "\n".join(server.log)
    assert "Traceback" not in text, text[text.index("Traceback") - 2000:][:6000]
    assert "Exception in ASGI application" not in text


def assert_serves(url: str) -> None:
    r = httpx.post(f"{url}/v1/audio/speech", json={"input": "After the fault.", "response_format": "pcm",
                                                    "forced_frames": 4}, timeout=60)
    assert r.status_code == 200 and len(r.content) > 0, (r.status_code, r.text[:300])


@pytest.mark.parametrize("stage", ["codec", "talker"])
def test_a_killed_worker_is_replaced_alone_under_load(server, stage):
    peer = "talker" if stage == "codec" else "codec"
    victim, survivor = worker_pid(server, stage), worker_pid(server, peer)
    before = metric(httpx.get(f"{server.url}/metrics").text, f"mossvox_engine_{stage}_restarts_total")
    with Load(server.url) as load:
        load.wait_for_audio()
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        wait_until(lambda: not ready(server.url), 10, "/ready noticing the death")
        downtime = wait_until(lambda: ready(server.url), DOWNTIME_BOUND_S, "the replica serving again")
        wait_until(lambda: any(o.started > t_kill + downtime and o.result == "ok" for o in load.outcomes),
                   60, "a request served after the restart")
    assert worker_pid(server, stage) != victim and worker_pid(server, peer) == survivor
    check_outcomes(load.outcomes, connections_may_drop=False)
    assert any(o.result in ("sse_error", "cut", "refused") for o in load.outcomes), "the fault hit no request"
    assert_serves(server.url)
    scrape = httpx.get(f"{server.url}/metrics").text
    assert metric(scrape, f"mossvox_engine_{stage}_restarts_total") == before + 1
    assert metric(scrape, "mossvox_engine_ready") == 1
    check_log(server)


def test_a_killed_api_process_is_replaced_while_the_other_serves(server):
    old = api_pids(server)
    assert len(old) == 2, old
    workers = {s: worker_pid(server, s) for s in ("talker", "codec")}
    victim = sorted(old)[0]
    with Load(server.url) as load:
        load.wait_for_audio()
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        took = wait_until(lambda: len(api_pids(server) - {victim}) == 2, 30, "a new API process")
        wait_until(lambda: any(o.started > t_kill + took and o.result == "ok" for o in load.outcomes),
                   60, "a request served after the replacement")
    check_outcomes(load.outcomes, connections_may_drop=True)
    lost = [o for o in load.outcomes if o.result != "ok"]
    assert all(o.started < t_kill + took for o in lost), lost  # only while the dead one's sockets went
    assert {s: worker_pid(server, s) for s in workers} == workers  # the engine noticed nothing
    assert any("API process slot" in line and "replaced by pid" in line for line in server.log)
    for _ in range(6):  # the kernel spreads connections over both processes: each one serves
        assert_serves(server.url)
    assert metric(httpx.get(f"{server.url}/metrics").text, "mossvox_engine_api_restarts_total") == 1
    check_log(server)


def test_a_stopped_worker_is_killed_and_replaced(server):
    victim = worker_pid(server, "codec")
    with Load(server.url, clients=2) as load:
        load.wait_for_audio()
        os.kill(victim, signal.SIGSTOP)
        try:
            wait_until(lambda: not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE,
                       20, "the hung codec being killed")
        finally:
            if psutil.pid_exists(victim):
                os.kill(victim, signal.SIGCONT)
        wait_until(lambda: ready(server.url), DOWNTIME_BOUND_S, "the replica serving again")
    check_outcomes(load.outcomes, connections_may_drop=False)
    assert max(o.ended - o.started for o in load.outcomes) < 40, "a request waited on the hung worker"
    assert metric(httpx.get(f"{server.url}/metrics").text, "mossvox_engine_hung_workers_total") == 1
    assert_serves(server.url)
    check_log(server)


def test_the_next_start_sweeps_what_a_killed_server_left(tmp_path):
    """SIGKILL of the main process leaves its workers to die with it, but its counters segment
    (and any ring not yet opened) and its metrics folder stay; the next start removes them."""
    first = ServerProcess(tmp_path / "a").start()
    pid = first.proc.pid
    instance = next(re.search(r"engine (\w+) replica 0 ready", line).group(1)
                    for line in first.log if re.search(r"engine (\w+) replica 0 ready", line))
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    wait_until(lambda: not any(p.ppid() == pid for p in psutil.process_iter(["ppid"])), 30, "its children dying")
    metrics_dirs = list(Path(tempfile.gettempdir()).glob(f"mossvox-metrics-{pid}-*"))
    assert metrics_dirs and list_segments(instance), "the killed server left nothing to sweep"
    second = ServerProcess(tmp_path / "b").start()
    try:
        assert list_segments(instance) == []
        assert not any(d.exists() for d in metrics_dirs)
    finally:
        second.stop()
