"""Attempts to exhaust a real server over loopback, each followed by a look at the server's state:
the API process's peak memory and descriptors, the limit counters of ``/metrics``, its log, and a
normal request still served. Every resource a client can make the server hold is bounded."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import psutil
import pytest
import soundfile

from tests.api.helpers import assert_error, data_url, labelled, tone_wav
from tests.api.server_process import ServerProcess

MB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), sets=(
        "model.max_new_frames=64",
    )).start()
    yield s
    s.stop()


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
