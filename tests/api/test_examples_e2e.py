"""The examples in `examples/` run against a real `mossvox serve` (tiny demo model, cpu profile,
an API key) as a user runs them: the Pipecat pipeline (through its ElevenLabs and its OpenAI
service) and the LiveKit agent's `say` command each write the reply, as long as its sentences'
forced lengths (cpu profile: random weights stop at random)."""

from __future__ import annotations

import subprocess
import sys
import wave

import pytest

from tests.api.helpers import FRAMES_PER_CHAR, FRAME_S
from tests.api.server_process import REPO, ServerProcess

KEY = "examples-key"
SENTENCES = ["This is the first sentence of the reply.", "And this is the second one, a little longer."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-key", KEY).start()
    yield s
    s.stop()


@pytest.mark.parametrize("command", [
    ["examples/pipecat_pipeline.py"],
    ["examples/pipecat_pipeline.py", "--service", "openai"],
    ["examples/livekit_agent.py", "say"],
], ids=["pipecat-elevenlabs", "pipecat-openai", "livekit"])
def test_an_example_speaks_the_reply(server, tmp_path, command):
    out = tmp_path / "reply.wav"
    script, *rest = command
    done = subprocess.run([sys.executable, script, "--url", server.url, "--key", KEY, "--out", str(out),
                           *rest, " ".join(SENTENCES)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with wave.open(str(out)) as audio:
        assert (audio.getframerate(), audio.getnchannels(), audio.getsampwidth()) == (24000, 1, 2)
        seconds = audio.getnframes() / 24000
    expected = sum(max(1, round(FRAMES_PER_CHAR * len(s))) * FRAME_S for s in SENTENCES)  # one request a sentence
    assert abs(seconds - expected) < 0.05, (seconds, expected)
