"""One request carrying every optional field, against any served model family.

`check_every_field` is the check each family's server gets (`tests/api/test_variants_server.py`
for the Delay family and Realtime, `tests/api/test_speech_e2e.py` for Local-v1.5): the request
with `ref_audio`, `ref_text`, `instructions` and `language` succeeds, `X-Ignored-Fields` names
exactly the fields the family ignores, the audio is sample for sample that of the request without
them, and where the family takes a reference the reference changes the audio.
"""

from __future__ import annotations

import httpx

from tests.api.helpers import data_url, tone_wav

EVERY_FIELD = {"ref_audio": data_url(tone_wav(1.5)), "ref_text": "The reference words.",
               "instructions": "a calm, low voice", "language": "English"}
HTTP_FIELDS = ("ref_audio", "voice", "ref_text", "instructions", "language")  # /v1/models order


def speech(http: httpx.Client, body: dict, frames: int = 6) -> httpx.Response:
    """A whole-file PCM request of `frames` forced frames (seed 7) that must succeed."""
    response = http.post("/v1/audio/speech", json={"response_format": "pcm", "forced_frames": frames, "seed": 7,
                                                   **body})
    assert response.status_code == 200, response.text
    frame_samples = int(response.headers["x-audio-sample-rate"]) * 2 // 25  # 80 ms
    assert len(response.content) == frames * frame_samples * 2 * int(response.headers["x-audio-channels"])
    return response


def check_every_field(http: httpx.Client, base: dict, ignored: tuple[str, ...]) -> None:
    """The family behind `http`, sent `base` plus every optional field, ignores exactly `ignored`."""
    takes_reference = "ref_audio" not in ignored
    card = http.get("/v1/models").json()["data"][0]  # the card says what it uses, up front
    assert card["request_fields"] == [f for f in HTTP_FIELDS if f.replace("voice", "ref_audio") not in ignored]
    full = speech(http, {**base, **EVERY_FIELD})
    assert full.headers.get("x-ignored-fields") == (", ".join(ignored) or None)
    assert ("x-ref-cache" in full.headers) == takes_reference  # an ignored clip is not even decoded
    # what it ignores changes nothing: the same samples come out without those fields
    kept = {k: v for k, v in EVERY_FIELD.items() if k not in ignored}
    bare = speech(http, {**base, **kept})
    assert "x-ignored-fields" not in bare.headers and bare.content == full.content
    if takes_reference:  # and the reference it takes is used: without it the audio differs
        unvoiced = speech(http, {**base, **{k: v for k, v in kept.items() if not k.startswith("ref_")}})
        assert unvoiced.content != full.content
