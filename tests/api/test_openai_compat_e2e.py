"""What an OpenAI speech client meets: model aliases and ``GET /v1/models/{id}``. One real
`mossvox serve` on loopback (tiny demo model, cpu profile), with an API key."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.helpers import assert_error, expected_seconds
from tests.api.server_process import ServerProcess

KEY = "compat-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALIASES = ["tts-1", "tts-1-hd", "gpt-4o-mini-tts"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-key", KEY).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as client:
        yield client


def test_openai_model_names_are_aliases_of_the_served_model(oai, http):
    listed = [model.id for model in oai.models.list()]
    assert listed[0] == "mossvox" and listed[-3:] == ALIASES  # the served name first, then the rest
    for name in listed:
        assert oai.models.retrieve(name).id == name
        speech = oai.audio.speech.create(model=name, voice="alloy", input="Alias.", response_format="pcm")
        assert len(speech.content) == pytest.approx(expected_seconds("Alias.") * 24000 * 2, abs=2 * 480)
    with pytest.raises(openai.NotFoundError) as missing:
        oai.models.retrieve("gpt-4o-tts-ultra")
    error = assert_error(http.post("/v1/audio/speech", json={"input": "hi", "model": "gpt-4o-tts-ultra"}),
                         404, param="model")
    for name in listed:  # the 404s name what is served, as the list does
        assert name in error["message"] and name in str(missing.value)
