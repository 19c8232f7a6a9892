"""A LiveKit agent whose voice is mossvox, through LiveKit's own ElevenLabs plugin: only the
plugin's base URL points elsewhere.

Run the server first (`make serve`: http://127.0.0.1:8000). Then, with nothing else:

    python examples/livekit_agent.py say "Hello! I am a voice agent."

streams the text into the plugin as an agent does and writes the audio to `reply.wav`. The agent
itself joins LiveKit rooms: with a LiveKit server (LIVEKIT_URL, LIVEKIT_API_KEY,
LIVEKIT_API_SECRET) and its speech-to-text and LLM (here through LiveKit Inference; any plugins
do), `python examples/livekit_agent.py dev` runs it, speaking through mossvox. Barge-in is the
plugin's: when the user talks over the agent, it stops playing and closes its context.

`--url`, `--key` and `--voice` (a voice registered with `POST /v1/audio/voices`, or default) go
before the command.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import wave

import aiohttp
from livekit.agents import Agent, AgentServer, AgentSession, JobContext, cli
from livekit.plugins import elevenlabs

SAMPLE_RATE = 24000
OPTIONS = {"url": "http://127.0.0.1:8000", "key": "unused", "voice": "default"}


def mossvox_tts(http_session: aiohttp.ClientSession | None = None) -> elevenlabs.TTS:
    """LiveKit's ElevenLabs plugin, pointed at the mossvox server. It sends whole sentences
    (auto_mode); mossvox has no character alignment, so the transcript follows the LLM's text."""
    return elevenlabs.TTS(base_url=f"{OPTIONS['url']}/v1", api_key=OPTIONS["key"],
                          voice_id=OPTIONS["voice"], encoding=f"pcm_{SAMPLE_RATE}",
                          sync_alignment=False, http_session=http_session)


server = AgentServer()


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    session = AgentSession(stt="deepgram/nova-3", llm="openai/gpt-4.1-mini", tts=mossvox_tts())
    await session.start(room=ctx.room, agent=Agent(
        instructions="You are a friendly voice assistant. Answer in one or two short sentences."))
    await session.generate_reply(instructions="Greet the user.")


async def say(text: str, out: str) -> None:
    """The plugin alone, as the agent drives it: text pushed in as it is written, audio out."""
    async with aiohttp.ClientSession() as http:
        tts = mossvox_tts(http)
        stream = tts.stream()
        for word in text.split(" "):
            stream.push_text(word + " ")
        stream.end_input()
        with wave.open(out, "wb") as file:
            file.setnchannels(1)
            file.setsampwidth(2)
            file.setframerate(SAMPLE_RATE)
            async for event in stream:
                file.writeframes(event.frame.data.tobytes())
        await stream.aclose()
        await tts.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=OPTIONS["url"], help="the mossvox server")
    parser.add_argument("--key", default=OPTIONS["key"], help="an API key of the server, if it has any")
    parser.add_argument("--voice", default=OPTIONS["voice"], help="a registered voice, or default")
    parser.add_argument("--out", default="reply.wav", help="where `say` writes its audio")
    parser.add_argument("command", help="say TEXT, or one of LiveKit's: dev, start, console")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    OPTIONS.update(url=args.url, key=args.key, voice=args.voice)
    if args.command == "say":
        asyncio.run(say(" ".join(args.rest), args.out))
        print(f"wrote {args.out}")
        return
    sys.argv = [sys.argv[0], args.command, *args.rest]
    cli.run_app(server)


if __name__ == "__main__":
    main()
