"""Test helper: drive headless Chromium over the DevTools protocol on a pipe (no extra packages).

``--remote-debugging-pipe`` makes Chromium read CDP commands from fd 3 and write replies to fd 4,
each a JSON object terminated by NUL.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--autoplay-policy=no-user-gesture-required", "--no-first-run", "--mute-audio",
         "--window-size=900,1000")


def find_chromium() -> str | None:
    return next((p for name in CHROMIUM_NAMES if (p := shutil.which(name))), None)


class Chromium:
    def __init__(self, binary: str) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        self._profile = tempfile.mkdtemp(prefix="mossvox-chromium-")
        # The child sees our pipe ends as fds 3 (commands in) and 4 (replies out).
        def wire_fds() -> None:  # runs in the child before exec; fds 3 and 4 are kept (pass_fds)
            high_r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
            high_w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen(
            [binary, *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={self._profile}", "about:blank"],
            pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=wire_fds)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._buffer = b""
        self.session: str | None = None

    def call(self, method: str, params: dict | None = None, *, session: bool = True, timeout: float = 30.0) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
        raise TimeoutError(method)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            import select

            ready, _, _ = select.select([self._from_chrome], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("no message from chromium")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the pipe")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(raw)

    def open_page(self, url: str) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        self.call("Page.enable")
        self.call("Page.navigate", {"url": url})

    def evaluate(self, expression: str, *, await_promise: bool = False):
        """The value of ``expression`` in the page (with ``await_promise``, of the promise it
        returns, once settled)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": await_promise})
        return result.get("result", {}).get("value")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])

    def close(self) -> None:
        try:
            self.call("Browser.close", session=False, timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)
        shutil.rmtree(self._profile, ignore_errors=True)
