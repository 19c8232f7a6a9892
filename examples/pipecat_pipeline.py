"""A Pipecat pipeline whose voice is mossvox, through Pipecat's own ElevenLabs (or OpenAI) TTS
service: only the service's URL points elsewhere.

Run the server first (`make serve`: http://127.0.0.1:8000), then

    python examples/pipecat_pipeline.py "Hello! I am a voice agent. What can I do for you?"

An LLM's reply, written a few words at a time, goes through the TTS service and the audio that
comes back is written to `reply.wav`. In a bot, the same service sits between the LLM and the
transport's output, e.g. `Pipeline([transport.input(), stt, user_aggregator, llm, tts,
transport.output(), assistant_aggregator])`; an interruption (the user talking over the bot)
stops the audio at once and frees the server's side.

Options: `--service openai` uses `OpenAITTSService` (`/v1/audio/speech`) instead of the
ElevenLabs WebSocket; `--voice NAME` a voice registered with `POST /v1/audio/voices` (ElevenLabs
service only: OpenAI's takes OpenAI's voice names, all the model's own voice here); `--key KEY`
when the server has API keys.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import wave

import httpx
from loguru import logger
from pipecat.frames.frames import (EndFrame, LLMFullResponseEndFrame, LLMFullResponseStartFrame,
                                   LLMTextFrame, TTSAudioRawFrame)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.workers.runner import WorkerRunner

SAMPLE_RATE = 24000  # the pipeline's output rate; the ElevenLabs service asks for pcm_24000


def mossvox_tts(url: str, key: str, voice: str, service: str):
    """Pipecat's TTS service, pointed at the mossvox server at `url`."""
    if service == "elevenlabs":
        return ElevenLabsTTSService(api_key=key, url=url.replace("http", "ws", 1),
                                    settings=ElevenLabsTTSService.Settings(voice=voice))
    model = httpx.get(f"{url}/v1/models", headers={"xi-api-key": key}).json()["data"][0]["id"]
    return OpenAITTSService(api_key=key, base_url=f"{url}/v1",
                            settings=OpenAITTSService.Settings(model=model, voice="alloy"))


class WavWriter(FrameProcessor):
    """Writes the TTS audio to a WAV file; `done` is set when the reply has been spoken."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.file = wave.open(path, "wb")
        self.file.setnchannels(1)
        self.file.setsampwidth(2)
        self.file.setframerate(SAMPLE_RATE)
        self.done = asyncio.Event()

    async def process_frame(self, frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.file.writeframes(frame.audio)
        elif isinstance(frame, LLMFullResponseEndFrame):  # comes after the reply's audio
            self.done.set()
        await self.push_frame(frame, direction)


async def speak(text: str, *, url: str, key: str, voice: str, service: str, out: str) -> None:
    writer = WavWriter(out)
    worker = PipelineWorker(Pipeline([mossvox_tts(url, key, voice, service), writer]),
                            params=PipelineParams(audio_out_sample_rate=SAMPLE_RATE),
                            cancel_on_idle_timeout=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    # what an LLM would push: a reply, a few words at a time
    await worker.queue_frame(LLMFullResponseStartFrame())
    words = text.split(" ")
    for at in range(0, len(words), 3):
        await worker.queue_frame(LLMTextFrame(text=" ".join(words[at:at + 3]) + " "))
    await worker.queue_frame(LLMFullResponseEndFrame())
    await writer.done.wait()
    await worker.queue_frame(EndFrame())
    await running
    writer.file.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the mossvox server")
    parser.add_argument("--key", default="unused", help="an API key of the server, if it has any")
    parser.add_argument("--voice", default="default", help="a registered voice, or default")
    parser.add_argument("--service", choices=("elevenlabs", "openai"), default="elevenlabs")
    parser.add_argument("--out", default="reply.wav")
    args = parser.parse_args()
    logger.remove()
    logger.add(sys.stderr, level="WARNING")  # Pipecat logs every frame at DEBUG
    asyncio.run(speak(args.text, url=args.url, key=args.key, voice=args.voice, service=args.service,
                      out=args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
