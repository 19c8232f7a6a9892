"""LiveKit Agents' TTS plugins, unchanged, against a real `mossvox serve` on loopback (tiny demo
model, cpu profile, an API key): `livekit.plugins.elevenlabs.TTS` (streamed: the multi-context
WebSocket; whole: `/v1/text-to-speech/{voice_id}/stream`) and `livekit.plugins.openai.TTS`
(`/v1/audio/speech`, which it asks for as server-sent events).

Text is spoken: the plugin yields audio frames at the rate of the format it asked for, mono, as
long as the sentences' forced lengths (cpu profile: random weights stop at random). An interruption
(the agent closes the stream) stops the audio, and the server frees every stage: at once where
text was still unsent or a request was still running, or once the sentences the plugin had
already flushed are spoken (ElevenLabs' close_context speaks flushed text to its end).
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import httpx
import pytest
from livekit.agents import APIConnectOptions
from livekit.plugins import elevenlabs, openai

from tests.api.helpers import aborted, engine_gauges, expected_seconds, wait_idle
from tests.api.server_process import ServerProcess

KEY = "livekit-test-key"
REPLY = ["Hello, I am the voice of this agent.", "I speak each sentence as it is written.",
         "Then I stop."]
LONG = "This sentence goes on and on " * 12 + "until it ends."
PATIENT = APIConnectOptions(timeout=60)  # a busy test machine may be slow to the first audio


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-key", KEY).start()
    yield s
    s.stop()


@contextlib.asynccontextmanager
async def eleven(server, **options):
    async with aiohttp.ClientSession() as session:
        tts = elevenlabs.TTS(api_key=KEY, base_url=f"{server.url}/v1", voice_id="default",
                             sync_alignment=False, http_session=session, **options)
        try:
            yield tts
        finally:
            await tts.aclose()


def served_model(server) -> str:
    return httpx.get(f"{server.url}/v1/models", headers={"xi-api-key": KEY}).json()["data"][0]["id"]


def frame_seconds(frames, rate: int) -> float:
    assert {(f.sample_rate, f.num_channels) for f in frames} == {(rate, 1)}
    return sum(f.samples_per_channel for f in frames) / rate


async def test_the_elevenlabs_plugin_streams_words_in_and_audio_out(server):
    async with eleven(server, encoding="pcm_24000") as tts:
        stream = tts.stream(conn_options=PATIENT)
        for word in " ".join(REPLY).split(" "):  # as an LLM writes it
            stream.push_text(word + " ")
        stream.end_input()
        frames = [event.frame async for event in stream]
        await stream.aclose()
    assert abs(frame_seconds(frames, 24000) - expected_seconds(*REPLY)) < 0.05


@pytest.mark.parametrize("encoding,rate", [("pcm_16000", 16000), ("mp3_44100_128", 44100)])
async def test_the_elevenlabs_plugin_synthesizes_whole_texts(server, encoding, rate):
    async with eleven(server, encoding=encoding) as tts:
        frames = [event.frame async for event in tts.synthesize(REPLY[0], conn_options=PATIENT)]
    assert abs(frame_seconds(frames, rate) - expected_seconds(REPLY[0])) < (0.05 if encoding.startswith("pcm") else 0.1)


@pytest.mark.parametrize("words", [False, True], ids=["sentences", "words"])
async def test_an_interruption_stops_the_elevenlabs_stream_and_frees_the_server(server, words):
    """Sentences (auto_mode, the default): each sentence goes out flushed, so the server speaks
    the ones it has to their end before it frees them; words (a chunk schedule): the text is
    unflushed, and closing the context stops it at once."""
    before = aborted(server.url)
    options = {"chunk_length_schedule": [50]} if words else {}
    async with eleven(server, encoding="pcm_16000", **options) as tts:
        stream = tts.stream(conn_options=PATIENT)
        stream.push_text(LONG + " And the next sentence is still being writ")
        first = await anext(stream)
        assert first.frame.samples_per_channel > 0
        await stream.aclose()  # the agent was interrupted
        assert not any((await asyncio.to_thread(wait_idle, server.url, 60)).values()), \
            "every stage freed its state"
        # the connection is the plugin's to keep: the next turn speaks on it
        again = tts.stream(conn_options=PATIENT)
        again.push_text(REPLY[0])
        again.end_input()
        frames = [event.frame async for event in again]
        await again.aclose()
    assert abs(frame_seconds(frames, 16000) - expected_seconds(REPLY[0])) < 0.05
    if words:
        assert aborted(server.url) > before, "the context was stopped, not spoken to its end"


async def test_the_openai_plugin_speaks_through_server_sent_events(server):
    tts = openai.TTS(api_key=KEY, base_url=f"{server.url}/v1", model=served_model(server), voice="alloy",
                     response_format="pcm")
    try:
        frames = [event.frame async for event in tts.synthesize(" ".join(REPLY), conn_options=PATIENT)]
    finally:
        await tts.aclose()
    # one request: the whole text as one input, its length forced from all of it
    assert abs(frame_seconds(frames, 24000) - expected_seconds(" ".join(REPLY))) < 0.05


async def test_an_interruption_stops_the_openai_plugin_and_frees_the_server(server):
    before = aborted(server.url)
    tts = openai.TTS(api_key=KEY, base_url=f"{server.url}/v1", model=served_model(server), voice="alloy",
                     response_format="pcm")
    try:
        stream = tts.synthesize(LONG, conn_options=PATIENT)
        first = await anext(stream)
        assert first.frame.samples_per_channel > 0
        assert (await asyncio.to_thread(engine_gauges, server.url))["running"] == 1
        await stream.aclose()
        assert not any((await asyncio.to_thread(wait_idle, server.url, 30)).values()), \
            "every stage freed its state"
        assert aborted(server.url) > before
    finally:
        await tts.aclose()
