"""Pipecat's TTS services, unchanged, against a real `mossvox serve` on loopback (tiny demo model,
cpu profile, an API key): `ElevenLabsTTSService` (the multi-context WebSocket),
`ElevenLabsHttpTTSService` (`/stream/with-timestamps`) and `OpenAITTSService`
(`/v1/audio/speech`), each the first processor of a real Pipecat pipeline.

An LLM reply written in pieces is spoken: the pipeline gets audio at its own output rate, mono,
as long as the sentences' forced lengths (cpu profile: random weights stop at random, so lengths
come from the text). An interruption while the bot speaks (Pipecat's barge-in) stops the audio
and frees every stage of the server.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import httpx
import pytest
from pipecat.frames.frames import (EndFrame, ErrorFrame, InterruptionFrame, LLMFullResponseEndFrame,
                                   LLMFullResponseStartFrame, LLMTextFrame, TTSAudioRawFrame)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService, ElevenLabsTTSService
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.workers.runner import WorkerRunner

from tests.api.helpers import aborted, engine_gauges, expected_seconds, wait_idle
from tests.api.server_process import ServerProcess

KEY = "pipecat-test-key"
REPLY = ["Hello, I am the voice of this agent.", "I speak each sentence as it is written.",
         "Then I stop."]
LONG = ["This sentence goes on and on " * 12 + "until it ends.", "Nobody hears this one."]
SERVICES = ["elevenlabs-websocket", "elevenlabs-http", "openai"]
RATES = {"elevenlabs-websocket": 16000, "elevenlabs-http": 22050, "openai": 24000}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-key", KEY).start()
    yield s
    s.stop()


class Recorder(FrameProcessor):
    """The pipeline's last processor: keeps the audio and errors, signals the end of a reply."""

    def __init__(self) -> None:
        super().__init__()
        self.audio: list[TTSAudioRawFrame] = []
        self.errors: list[ErrorFrame] = []
        self.heard = asyncio.Event()
        self.reply_ended = asyncio.Event()

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio.append(frame)
            self.heard.set()
        elif isinstance(frame, ErrorFrame):
            self.errors.append(frame)
        elif isinstance(frame, LLMFullResponseEndFrame):  # queued behind the reply's audio
            self.reply_ended.set()
        await self.push_frame(frame, direction)

    @property
    def seconds(self) -> float:
        return sum(len(f.audio) / 2 / f.sample_rate for f in self.audio)


@contextlib.asynccontextmanager
async def pipeline(server, service: str):
    """A running pipeline of the `service` TTS and a `Recorder`, ended when the block ends."""
    async with aiohttp.ClientSession() as session:
        tts = make_tts(server, service, session)
        recorder = Recorder()
        worker = PipelineWorker(Pipeline([tts, recorder]), cancel_on_idle_timeout=False,
                                params=PipelineParams(audio_out_sample_rate=RATES[service]))
        started = asyncio.Event()

        @worker.event_handler("on_pipeline_started")
        async def on_started(worker, frame) -> None:
            started.set()

        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        running = asyncio.create_task(runner.run())
        try:
            await asyncio.wait_for(started.wait(), 60)
            yield worker, recorder
        finally:
            await worker.queue_frame(EndFrame())
            await asyncio.wait_for(running, 60)


def make_tts(server, service: str, session: aiohttp.ClientSession):
    # a silence of 3 s (Pipecat's default) ends an audio context early on a busy test machine
    common = {"stop_frame_timeout_s": 60.0}
    if service == "elevenlabs-websocket":
        return ElevenLabsTTSService(api_key=KEY, url=server.url.replace("http://", "ws://"),
                                    settings=ElevenLabsTTSService.Settings(voice="default"), **common)
    if service == "elevenlabs-http":
        return ElevenLabsHttpTTSService(api_key=KEY, base_url=server.url, aiohttp_session=session,
                                        settings=ElevenLabsHttpTTSService.Settings(voice="default"), **common)
    served = httpx.get(f"{server.url}/v1/models", headers={"xi-api-key": KEY}).json()["data"][0]["id"]
    return OpenAITTSService(api_key=KEY, base_url=f"{server.url}/v1",
                            settings=OpenAITTSService.Settings(model=served, voice="alloy"), **common)


async def write_reply(worker, sentences: list[str], *, end: bool = True) -> None:
    """An LLM reply, a few words at a time."""
    await worker.queue_frame(LLMFullResponseStartFrame())
    for sentence in sentences:
        words = sentence.split(" ")
        for at in range(0, len(words), 3):
            await worker.queue_frame(LLMTextFrame(text=" ".join(words[at:at + 3]) + " "))
    if end:
        await worker.queue_frame(LLMFullResponseEndFrame())


@pytest.mark.parametrize("service", SERVICES)
async def test_a_reply_is_spoken_at_the_pipelines_rate(server, service):
    async with pipeline(server, service) as (worker, recorder):
        await write_reply(worker, REPLY)
        await asyncio.wait_for(recorder.reply_ended.wait(), 120)
    assert not recorder.errors, recorder.errors
    assert {(f.sample_rate, f.num_channels) for f in recorder.audio} == {(RATES[service], 1)}
    assert abs(recorder.seconds - expected_seconds(*REPLY)) < 0.05, recorder.seconds


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize("written", [False, True], ids=["while-writing", "after-writing"])
async def test_an_interruption_stops_the_audio_and_frees_the_server(server, service, written):
    """Barge-in while the bot speaks the first sentence: the LLM still writing, or done writing
    (the ElevenLabs socket then has the context's flush and close already)."""
    before = aborted(server.url)
    async with pipeline(server, service) as (worker, recorder):
        await write_reply(worker, LONG, end=written)
        await asyncio.wait_for(recorder.heard.wait(), 60)
        assert engine_gauges(server.url)["running"] >= 1  # still generating
        await worker.queue_frame(InterruptionFrame())
        # waited for in a thread: the pipeline runs on this event loop
        assert not any((await asyncio.to_thread(wait_idle, server.url, 30)).values()), \
            "every stage freed its state"
        assert aborted(server.url) > before, "the sentence was stopped, not spoken to its end"
        heard = recorder.seconds
    assert heard < expected_seconds(LONG[0]) / 2
    assert not recorder.errors, recorder.errors
