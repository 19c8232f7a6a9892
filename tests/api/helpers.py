"""Shared pieces of the end-to-end API tests (real server on loopback, tiny demo model)."""

from __future__ import annotations

import base64
import io
import json
import re
import time

import httpx
import numpy as np
import soundfile

from engine.counters import LEAK_GAUGES

FRAMES_PER_CHAR = 0.87  # the cpu profile forces each request's length from its text
FRAME_S = 0.08


def expected_seconds(*texts: str) -> float:
    """The audio the cpu profile makes of these texts, one request each."""
    return sum(max(1, round(FRAMES_PER_CHAR * len(text))) * FRAME_S for text in texts)


def tone_wav(seconds: float, rate: int = 16000, hz: float = 220.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), rate, format="WAV",
                    subtype="PCM_16")
    return buf.getvalue()


def data_url(wav: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(wav).decode()


def assert_error(response: httpx.Response, status: int, *, param: str | None = None,
                 contains: str | None = None) -> dict:
    """The response is ``status`` with a well-formed OpenAI error envelope."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if contains is not None:
        assert contains in error["message"], error["message"]
    return error


def parse_sse(body: bytes) -> list[tuple[str, dict]]:
    events = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        name = re.search(r"^event: (.*)$", block, re.M).group(1)
        data = json.loads(re.search(r"^data: (.*)$", block, re.M).group(1))
        events.append((name, data))
    return events


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample (or the sum over its labelled samples)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"metric {name} missing"
    return total


def labelled(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def engine_gauges(url: str) -> dict[str, float]:
    """What the engine holds now: every leak gauge, and the client's open requests."""
    text = httpx.get(url + "/metrics").text
    return {key: metric(text, f"mossvox_engine_{key}") for key in (*LEAK_GAUGES, "client_open")}


def aborted(url: str) -> float:
    """Requests the engine aborted before they finished, so far."""
    return metric(httpx.get(url + "/metrics").text, "mossvox_engine_aborted_total")


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """The engine's gauges once all are zero (or as they are after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = engine_gauges(url)
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.1)
