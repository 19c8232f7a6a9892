"""A variant registered from this test module is served end to end: the real engine (spawned talker
and codec workers, coordinator, rings) behind the real HTTP app (uvicorn, Starlette).

`ToyVariant` is all a new family writes: a `Variant` subclass naming its `model_type`, a request
adapter, and a talker runner (it declares no optional request fields, so it ignores them all). Nothing of mossvox names it; the registry finds it because this
module defined it, and the workers import this module when they unpickle their spec. Its talker
speaks one frame per word of the input, with codes that are a function of the frame index, so the
audio that comes back over HTTP can be checked against the codec decoding those codes directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import httpx
import numpy as np
import pytest
import torch
import uvicorn

from profiles import load_profile
from speech.job import SpeechJob
from speech.sampling import SamplingParams
from stages.registry import load_variant
from stages.runtime.talker_runner import FrameEvent
from stages.tools.make_checkpoint import codec_config, write_codec
from stages.variant import AdapterError, TalkerRequest, Variant

MODEL_TYPE = "mossvox_toy_test"
N_VQ = 4
TEXT = "one two three four five six seven"


def toy_codes(frame: int) -> np.ndarray:
    """The toy's frame `frame`: `[n_vq]` int64, a function of the index only."""
    return (np.arange(N_VQ, dtype=np.int64) * 97 + frame * 31) % 1024


class ToyRunner:
    """A talker runner without a model: one frame per prompt row, then "stop"."""

    n_vq = N_VQ
    frame_rate = 12.5
    max_running = 4

    def __init__(self) -> None:
        self.requests: dict[int, list[int]] = {}  # rid -> [frames to emit, frames emitted]

    def can_admit(self, prompt_len: int) -> bool:
        return len(self.requests) < self.max_running

    def add(self, rid: int, prompt: np.ndarray, params: SamplingParams) -> None:
        self.requests[rid] = [len(prompt), 0]

    def step(self) -> list[FrameEvent]:
        events = []
        for rid, state in self.requests.items():
            total, done = state
            state[1] = done + 1
            finished = done + 1 == total
            events.append(FrameEvent(rid, toy_codes(done), finished, "stop" if finished else None))
        return events

    def remove(self, rid: int) -> None:
        self.requests.pop(rid, None)

    def num_running(self) -> int:
        return len(self.requests)

    def capture_ahead(self, budget_s: float, progress=None) -> int:
        return 0

    def capture_decode_graphs(self, budget_s: float, progress=None) -> int:
        return 0

    def max_prompt_rows(self) -> int:
        return 0

    def close(self) -> None:
        pass


class ToyVariant(Variant):
    """A family of one: a prompt row per word, the toy runner, the shared codec runner."""

    model_types = (MODEL_TYPE,)
    description = "the toy variant of tests/api/test_toy_variant.py"
    name = "mossvox-toy"

    def adapt(self, job: SpeechJob) -> TalkerRequest:
        words = job.text.split()
        if "?" in job.text:
            raise AdapterError("the toy answers no questions")
        return TalkerRequest(np.zeros((len(words), 1 + self.n_vq), dtype=np.int64), self.resolve_sampling(job))

    def make_talker_runner(self, device: str) -> ToyRunner:
        return ToyRunner()


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    """A checkpoint of the toy: its config.json and a tiny random-weight v2 codec."""
    root = tmp_path_factory.mktemp("toy")
    (root / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE, "n_vq": N_VQ}))
    write_codec(root / "audio_tokenizer", codec_config("tiny"), seed=5, dtype=torch.float32,
                max_shard_bytes=1 << 30)
    return root


@contextlib.asynccontextmanager
async def serving(profile, model_dir):
    """The engine and one in-process API server on a loopback port; yields its base URL."""
    from api.app import create_app
    from engine.launcher import launch

    handle = await launch(profile, model_dir)

    @contextlib.asynccontextmanager
    async def connect():
        yield handle.client(0)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(profile, connect), lifespan="on", log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), "the API server did not start"
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()
        await handle.stop()


def test_the_registry_finds_a_variant_defined_in_a_test_module(toy_dir) -> None:
    variant = load_variant(toy_dir, load_profile("cpu"))
    assert type(variant) is ToyVariant and variant.n_vq == N_VQ


async def test_a_toy_variant_is_served_over_http(toy_dir, tmp_path) -> None:
    profile = load_profile("cpu", [f"api.data_dir={tmp_path}"])
    variant = ToyVariant(toy_dir, profile)
    async with serving(profile, toy_dir) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            response = await http.post("/v1/audio/speech", json={  # the codec's own samples
                "input": TEXT, "response_format": "pcm", "sample_rate": variant.sample_rate,
                "channels": variant.channels})
            refused = await http.post("/v1/audio/speech", json={"input": "why?", "response_format": "pcm"})
            unused = await http.post("/v1/audio/speech", json={  # the same layout as `response`
                "input": TEXT, "response_format": "pcm", "sample_rate": variant.sample_rate,
                "channels": variant.channels, "language": "English", "ref_text": "words"})
    assert response.status_code == 200, response.text
    assert int(response.headers["X-Audio-Sample-Rate"]) == variant.sample_rate
    frames = len(TEXT.split())  # the toy's rule: one frame per word
    got = np.frombuffer(response.content, dtype="<i2").reshape(-1, variant.channels)  # [S, C]
    assert len(got) == frames * variant.samples_per_frame
    # the same codes decoded here, in one call (streaming decode equals the whole decode)
    codec = variant.make_codec_runner("cpu")
    codec.open(0)
    pcm = codec.decode([(0, np.stack([toy_codes(k) for k in range(frames)]))])[0]  # [C, S]
    want = np.rint(np.clip(pcm.T, -1.0, 1.0) * 32767.0)
    assert np.abs(got.astype(np.float64) - want).max() <= 1.0 and np.abs(want).max() > 0
    # the toy's adapter refused it: a client error naming the rule, not a crash
    assert refused.status_code == 400 and "no questions" in refused.json()["error"]["message"]
    # a family that declares no optional fields ignores them all, says so, and makes the same audio
    assert unused.status_code == 200 and unused.headers["X-Ignored-Fields"] == "ref_text, language"
    assert unused.content == response.content
