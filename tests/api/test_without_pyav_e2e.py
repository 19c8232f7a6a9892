"""An API process loads PyAV (FFmpeg) only when a request needs it: a server whose Python cannot
import `av` serves raw PCM and WAV at the model's own layout, with WAV reference clips, and
answers a format that needs FFmpeg with an error instead of failing to start."""

from __future__ import annotations

import os

import pytest

from tests.api.helpers import data_url, tone_wav
from tests.api.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    shim = tmp_path_factory.mktemp("no_pyav")
    (shim / "av").mkdir()
    (shim / "av" / "__init__.py").write_text('raise ImportError("PyAV is not installed here")\n')
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    s = ServerProcess(tmp_path_factory.mktemp("data"), env={"PYTHONPATH": path}).start()
    yield s
    s.stop()


def test_pcm_and_wav_with_a_wav_clip_need_no_pyav(http):
    card = http.get("/v1/models").json()["data"][0]
    native = {"sample_rate": card["sample_rate"], "channels": card["channels"]}
    for fmt in ("pcm", "wav"):
        response = http.post("/v1/audio/speech", json={
            "model": card["id"], "input": "No FFmpeg on this path.", "response_format": fmt,
            "ref_audio": data_url(tone_wav(2.0)), **native})
        assert response.status_code == 200 and len(response.content) > 44, (fmt, response.text[:200])


def test_what_needs_ffmpeg_is_a_clear_error_and_the_server_keeps_serving(http):
    card = http.get("/v1/models").json()["data"][0]
    for fields in ({"response_format": "mp3"},  # compressed
                   {"response_format": "pcm", "sample_rate": 16000, "channels": card["channels"]}):  # resampled
        response = http.post("/v1/audio/speech", json={"model": card["id"], "input": "Needs FFmpeg.", **fields})
        assert response.status_code == 501, (fields, response.text[:200])
        error = response.json()["error"]
        assert error["code"] == "format_unavailable" and "PyAV" in error["message"], error
    mp3_clip = data_url(b"\xff\xfb\x90\x00" * 2000)  # not a file libsndfile reads
    response = http.post("/v1/audio/speech", json={"model": card["id"], "input": "An mp3 clip.",
                                                    "response_format": "wav", "ref_audio": mp3_clip})
    assert response.status_code == 400 and "PyAV" in response.json()["error"]["message"]
    again = http.post("/v1/audio/speech", json={"model": card["id"], "input": "Still here.", "response_format": "pcm",
                                                 "sample_rate": card["sample_rate"], "channels": card["channels"]})
    assert again.status_code == 200 and again.content
