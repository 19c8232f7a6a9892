"""A small test client of `WS /v1/audio/speech/stream`: send messages, read one utterance's events
and audio, grouped by sentence."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx
import websockets

from tests.api.helpers import metric


@dataclass
class SpokenSentence:
    start: dict
    audio: bytearray = field(default_factory=bytearray)
    done: dict | None = None


@dataclass
class Utterance:
    sentences: list[SpokenSentence] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # every JSON event, in order
    done: dict | None = None  # session.done

    @property
    def audio(self) -> bytes:
        return b"".join(bytes(s.audio) for s in self.sentences)


def ws_url(http_url: str) -> str:
    return http_url.replace("http://", "ws://") + "/v1/audio/speech/stream"


def connect(http_url: str, query: str = "", **kw):
    return websockets.connect(ws_url(http_url) + query, max_size=None, **kw)


async def send(ws, kind: str, **fields) -> None:
    await ws.send(json.dumps({"type": kind, **fields}))


async def next_event(ws, timeout: float = 60.0) -> dict | bytes:
    message = await asyncio.wait_for(ws.recv(), timeout)
    return message if isinstance(message, bytes) else json.loads(message)


async def read_utterance(ws, timeout: float = 60.0, until: str = "session.done",
                         into: Utterance | None = None) -> Utterance:
    """Events and audio until `until` (session.done, or another event type), added to `into`."""
    got = into or Utterance()
    while True:
        message = await next_event(ws, timeout)
        if isinstance(message, bytes):
            assert got.sentences and got.sentences[-1].done is None, "audio outside a sentence"
            got.sentences[-1].audio += message
            continue
        got.events.append(message)
        kind = message["type"]
        if kind == "audio.start":
            got.sentences.append(SpokenSentence(message))
        elif kind == "audio.done":
            got.sentences[-1].done = message
        if kind == until:
            if kind == "session.done":
                got.done = message
            return got


async def speak(ws, pieces: list[str], **config) -> Utterance:
    """One utterance: config (when given), the pieces as input.text, input.done; its audio."""
    if config:
        await send(ws, "session.config", **config)
    for piece in pieces:
        await send(ws, "input.text", text=piece)
    await send(ws, "input.done")
    return await read_utterance(ws)


async def speak_queued(http_url: str, texts: list[str], **config) -> tuple[list[Utterance], list[float]]:
    """One session queues every text as its own utterance before the first is spoken, then reads
    them all; meanwhile `/metrics` is sampled every 50 ms. Returns the utterances and the samples
    of `mossvox_engine_client_open` (the session's requests in the engine)."""
    seen: list[float] = []

    async def watch(stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=http_url) as http:
            while not stop.is_set():
                seen.append(metric((await http.get("/metrics")).text, "mossvox_engine_client_open"))
                await asyncio.sleep(0.05)

    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(stop))
    try:
        async with connect(http_url) as ws:
            await send(ws, "session.config", **config)
            for text in texts:
                await send(ws, "input.text", text=text)
                await send(ws, "input.done")
            got = [await read_utterance(ws) for _ in texts]
    finally:
        stop.set()
        await watcher
    return got, seen
