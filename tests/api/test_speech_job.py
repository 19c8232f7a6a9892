"""Request body -> engine job: sampling precedence, output mode, request checks."""

from __future__ import annotations

import pytest

from api.errors import ApiError
from api.request_limits import RequestLimits
from api.schemas import decode_speech_request, openapi_document
from api.speech_job import check_request, output_plan, sampling_overrides
from profiles import load_profile

LIMITS = RequestLimits(max_input_chars=10, max_chunk_frames=20, max_frames=50,
                       chunk_limit_key="ipc.pcm_ring_bytes")


def req(**fields):
    import json

    return decode_speech_request(json.dumps({"input": "hello", **fields}).encode())


def test_top_level_sampling_beats_extra_params_and_names_map_to_the_adapter():
    r = req(temperature=0.5, extra_params={"temperature": 1.5, "top_k": 7}, seed=3, max_new_tokens=20)
    assert sampling_overrides(r) == {"temperature": 0.5, "top_k": 7, "seed": 3, "max_new_frames": 20}
    assert sampling_overrides(req()) == {}


def plan(pcm_layout="openai", **fields):
    return output_plan(req(**fields), native_rate=48000, native_channels=2, pcm_layout=pcm_layout)


@pytest.mark.parametrize("fields,mode", [({}, "audio"), ({"stream": True}, "sse"), ({"stream": False}, "file"),
                                         ({"stream_format": "audio"}, "audio"),
                                         ({"stream": True, "stream_format": "audio"}, "audio"),
                                         ({"response_format": "flac"}, "file"),
                                         ({"response_format": "flac", "stream_format": "audio"}, "audio"),
                                         ({"response_format": "pcm"}, "audio")])
def test_output_mode_streams_unless_asked_not_to(fields, mode):
    assert plan(**fields).mode == mode


def test_openai_default_format_is_mp3():
    assert plan().response_format == "mp3"


@pytest.mark.parametrize("fields,layout,rate,channels", [
    ({"response_format": "pcm"}, "openai", 24000, 1),
    ({"response_format": "pcm"}, "native", 48000, 2),
    ({"response_format": "pcm", "sample_rate": 48000}, "openai", 48000, 1),
    ({"response_format": "pcm", "channels": 2}, "openai", 24000, 2),
    ({"response_format": "pcm", "sample_rate": 16000, "channels": 1}, "native", 16000, 1),
    ({"response_format": "wav"}, "openai", 48000, 2),
    ({"response_format": "mp3", "channels": 1}, "openai", 48000, 1),
    ({"response_format": "opus", "sample_rate": 24000}, "native", 24000, 2)])
def test_pcm_takes_openais_layout_unless_asked_and_other_formats_the_models(fields, layout, rate, channels):
    got = plan(layout, **fields)
    assert (got.sample_rate, got.channels) == (rate, channels)


def test_channels_are_one_or_two():
    for bad in (0, 3, "2"):
        with pytest.raises(ApiError) as err:
            req(channels=bad)
        assert err.value.param == "channels"


@pytest.mark.parametrize("fields,status,param", [
    ({"model": "other"}, 404, "model"), ({"input": " \n"}, 400, "input"), ({"input": "x" * 11}, 400, "input"),
    ({"sample_rate": 12345}, 400, "sample_rate")])
def test_check_request_errors(fields, status, param):
    with pytest.raises(ApiError) as err:
        check_request(req(**fields), model_names={"mossvox", "moss-tts-local-v1.5"}, limits=LIMITS,
                      sample_rate=48000)
    assert (err.value.status, err.value.param) == (status, param)


@pytest.mark.parametrize("stream_format", ["sse", "audio"])
def test_a_whole_file_and_a_stream_at_once_are_refused_naming_both(stream_format):
    with pytest.raises(ApiError) as err:
        check_request(req(stream=False, stream_format=stream_format), model_names={"mossvox"},
                      limits=LIMITS, sample_rate=48000)
    assert (err.value.status, err.value.param) == (400, "stream_format")
    assert "'stream': false" in err.value.message and f"'stream_format': '{stream_format}'" in err.value.message


def test_a_value_outside_a_fields_choices_lists_the_valid_ones():
    with pytest.raises(ApiError) as err:
        req(response_format="ogg")
    assert err.value.param == "response_format"
    assert err.value.message.endswith("expected one of: aac, flac, mp3, opus, pcm, wav")


def test_check_request_accepts_either_model_name_and_the_output_rates():
    for model, rate in (("mossvox", 48000), ("moss-tts-local-v1.5", 16000), (None, 44100), (None, 8000)):
        check_request(req(model=model, sample_rate=rate), model_names={"mossvox", "moss-tts-local-v1.5"},
                      limits=LIMITS, sample_rate=48000)


def test_openapi_schema_is_the_validating_schema():
    schema = openapi_document()["components"]["schemas"]["SpeechRequest"]
    assert schema["required"] == ["input"]
    assert schema["properties"]["speed"]["minimum"] == 0.25 and schema["properties"]["speed"]["maximum"] == 4.0
    assert set(schema["properties"]["response_format"]["enum"]) == {"mp3", "opus", "aac", "flac", "wav", "pcm"}
    with pytest.raises(ApiError):
        req(speed=4.5)


@pytest.mark.parametrize("field,value,key", [
    ("initial_codec_chunk_frames", 21, "ipc.pcm_ring_bytes"), ("forced_frames", 51, "model.max_new_frames"),
    ("max_new_tokens", 51, "model.max_new_frames"), ("instructions", "y" * 11, "api.max_input_chars"),
    ("ref_text", "z" * 11, "api.max_input_chars")])
def test_fields_that_size_records_are_bounded_by_the_engine(field, value, key):
    with pytest.raises(ApiError) as err:
        check_request(req(**{field: value}), model_names={"mossvox"}, limits=LIMITS, sample_rate=48000)
    assert (err.value.status, err.value.param) == (400, field)
    assert key in err.value.message and str(LIMITS.bounds()[field][1]) in err.value.message
    check_request(req(**{field: value[:-1] if isinstance(value, str) else value - 1}), model_names={"mossvox"},
                  limits=LIMITS, sample_rate=48000)


def test_chunk_bound_is_what_one_ring_record_carries():
    """48 kHz stereo float32 is 30720 bytes a frame: a 16 MiB PCM ring (8 MiB records) carries
    273 frames, so the 300-frame first chunk that once killed the codec worker is refused."""
    cpu = load_profile("cpu")
    limits = RequestLimits.for_engine(cpu, channels=2, samples_per_frame=3840, n_vq=12)
    assert limits.max_chunk_frames == 273 and limits.chunk_limit_key == "ipc.pcm_ring_bytes"
    assert limits.max_frames == cpu.model.max_new_frames and limits.max_input_chars == cpu.api.max_input_chars
    with pytest.raises(ApiError):
        limits.check(req(initial_codec_chunk_frames=300))


def test_openapi_states_the_engine_bounds():
    schema = LIMITS.apply_to_schema(openapi_document())["components"]["schemas"]["SpeechRequest"]["properties"]
    assert schema["input"]["maxLength"] == 10
    assert {"type": "integer", "minimum": 1, "maximum": 20} in schema["initial_codec_chunk_frames"]["anyOf"]
    assert {"type": "integer", "minimum": 1, "maximum": 50} in schema["max_new_tokens"]["anyOf"]


def test_every_number_in_the_request_schemas_is_bounded():
    components = openapi_document()["components"]["schemas"]

    def numbers(node):
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number"):
                yield node
            for child in node.values():
                yield from numbers(child)
        elif isinstance(node, list):
            for child in node:
                yield from numbers(child)

    for name in ("SpeechRequest", "ExtraParams", "VoiceUploadForm"):
        for node in numbers(components[name]):
            assert {"minimum", "exclusiveMinimum"} & set(node) and {"maximum", "exclusiveMaximum"} & set(node), \
                (name, node)


@pytest.mark.parametrize("body", [{"top_k": 2**63}, {"extra_params": {"top_k": 10**20}}, {"sample_rate": 2**40},
                                  {"language": "x" * 65}, {"model": "m" * 257}])
def test_out_of_range_numbers_and_strings_are_400s(body):
    with pytest.raises(ApiError) as err:
        req(**body)
    assert err.value.status == 400
