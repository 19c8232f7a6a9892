"""Test helpers: a real `mossvox serve` process on loopback (tiny demo model, cpu profile), and the
stub speech server (`tests.api.stub_speech_server`) in a process of its own."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


class ServerProcess:
    """Start with ``start()``; ``url`` is the base URL; ``stop()`` sends SIGTERM and waits.
    `profile`: the profile served (`cpu` unless a GPU test names another)."""

    def __init__(self, data_dir: Path, *args: str, sets: tuple[str, ...] = (), cwd: Path = REPO,
                 start_timeout_s: float = START_TIMEOUT_S, env: dict[str, str] | None = None,
                 profile: str = "cpu") -> None:
        self.profile = profile
        self.data_dir = Path(data_dir)
        self.cwd = cwd
        self.start_timeout_s = start_timeout_s  # longer when several servers start at once
        self.args = args
        self.sets = sets
        self.env = env or {}  # more environment for the server's processes
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.log: list[str] = []

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-c", "import sys; from cli.main import main; sys.exit(main())", "serve",
               "--profile", self.profile, "--port", "0", *self.args,
               "--set", f"api.data_dir={self.data_dir}"]
        for item in self.sets:
            cmd += ["--set", item]
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        found = threading.Event()

        def pump() -> None:
            assert self.proc and self.proc.stdout
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                match = re.search(r"serving on (http://\S+)", line)
                if match:
                    self.url = match.group(1)
                    found.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not found.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not start:\n" + "\n".join(self.log[-40:]))
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server never became ready:\n" + "\n".join(self.log[-40:]))

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._pump.join(10)  # every line the server wrote is in `log`
        return self.proc.returncode


@contextlib.contextmanager
def stub_speech_server() -> Iterator[str]:
    """The stub speech server on a free loopback port, until the block ends: yields its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tests.api.stub_speech_server", "--port", str(port)],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert "stub serving" in proc.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models").status_code == 200:
                    break
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
