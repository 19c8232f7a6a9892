"""Request body -> engine job: sampling precedence, output mode, request checks."""

from __future__ import annotations

import pytest

from api.errors import ApiError
from api.schemas import decode_speech_request, openapi_document
from api.speech_job import check_request, output_plan, sampling_overrides


def req(**fields):
    import json

    return decode_speech_request(json.dumps({"input": "hello", **fields}).encode())


def test_top_level_sampling_beats_extra_params_and_names_map_to_the_adapter():
    r = req(temperature=0.5, extra_params={"temperature": 1.5, "top_k": 7}, seed=3, max_new_tokens=20)
    assert sampling_overrides(r) == {"temperature": 0.5, "top_k": 7, "seed": 3, "max_new_frames": 20}
    assert sampling_overrides(req()) == {}


@pytest.mark.parametrize("fields,mode", [({}, "file"), ({"stream": True}, "sse"),
                                         ({"stream_format": "audio"}, "audio"),
                                         ({"stream": True, "stream_format": "audio"}, "audio"),
                                         ({"stream_format": "sse", "stream": False}, "sse")])
def test_output_mode(fields, mode):
    assert output_plan(req(**fields)).mode == mode


def test_openai_default_format_is_mp3():
    assert output_plan(req()).response_format == "mp3"


@pytest.mark.parametrize("fields,status,param", [
    ({"model": "other"}, 404, "model"), ({"input": " \n"}, 400, "input"), ({"input": "x" * 11}, 400, "input"),
    ({"sample_rate": 12345}, 400, "sample_rate")])
def test_check_request_errors(fields, status, param):
    with pytest.raises(ApiError) as err:
        check_request(req(**fields), model_names={"mossvox", "moss-tts-local-v1.5"}, max_input_chars=10,
                      sample_rate=48000)
    assert (err.value.status, err.value.param) == (status, param)


def test_check_request_accepts_either_model_name_and_the_output_rates():
    for model, rate in (("mossvox", 48000), ("moss-tts-local-v1.5", 16000), (None, 44100), (None, 8000)):
        check_request(req(model=model, sample_rate=rate), model_names={"mossvox", "moss-tts-local-v1.5"},
                      max_input_chars=10, sample_rate=48000)


def test_openapi_schema_is_the_validating_schema():
    schema = openapi_document()["components"]["schemas"]["SpeechRequest"]
    assert schema["required"] == ["input"]
    assert schema["properties"]["speed"]["minimum"] == 0.25 and schema["properties"]["speed"]["maximum"] == 4.0
    assert set(schema["properties"]["response_format"]["enum"]) == {"mp3", "opus", "aac", "flac", "wav", "pcm"}
    with pytest.raises(ApiError):
        req(speed=4.5)
