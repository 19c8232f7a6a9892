"""How soon a voice agent hears its reply: the first audio after the first sentence's last word,
over ElevenLabs' multi-context WebSocket, `/v1/audio/speech/stream` and HTTP, at several
concurrencies, against a running server (`python -m bench.agent_latency`).

Each of C clients plays an agent whose LLM writes replies of three sentences, one word every
``--word-ms`` (20 ms: a fast LLM), and sends them the way that protocol's agent clients do:
- ``elevenlabs``: one ``/v1/text-to-speech/default/multi-stream-input`` socket a client
  (``auto_mode=true``), a context a reply: each sentence sent whole the moment its last word is
  written (Pipecat's and LiveKit's ElevenLabs services), then ``flush`` and ``close_context``; the
  reply is over at its ``isFinal``.
- ``stream``: one ``/v1/audio/speech/stream`` socket a client: each word sent as ``input.text`` as
  it is written, ``input.done`` after the last; the reply is over at its ``session.done``. The
  server knows a sentence has ended only when the next word begins (`speech.segmenter`), one
  word later.
- ``http``: each sentence ``POST``ed to ``/v1/audio/speech`` (audio streamed) the moment its
  last word is written, one request after the other (Pipecat's OpenAI service).
The figure: from sending the first sentence's last word (the sentence itself, for elevenlabs and
http) to the first audio bytes of the reply. Every protocol asks for the same audio, pcm at
24 kHz mono (OpenAI's layout, the agents' usual one), so the server does the same work. Each
client sends ``--replies`` replies in a closed loop; a reply's sentences come from a fixed pool,
by client and reply, so every run sends the same texts. Random weights stop at random: serve with
``--set model.force_length_from_text=true`` so every protocol gets the same lengths.

    python -m bench.agent_latency --url http://127.0.0.1:8000 --concurrency 1,16,64
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass

import httpx
import numpy as np
import websockets

from bench.levels import add_concurrency_option, levels_of

PROTOCOLS = ("elevenlabs", "stream", "http")
SAMPLE_RATE = 24000
POOL = [  # agent-like sentences, 40 to 110 characters
    "Thanks for calling, I can help you with that right away.",
    "Your order shipped yesterday and should arrive on Thursday.",
    "Let me check the availability for the dates you mentioned.",
    "I found three flights that leave in the morning.",
    "The cheapest one has a short layover in Denver.",
    "Would you like me to reserve a seat by the window?",
    "Your appointment is confirmed for next Tuesday at ten.",
    "I have sent the details to the email address on file.",
    "The weather tomorrow looks sunny with a light breeze in the afternoon.",
    "Is there anything else I can do for you today?",
    "That plan includes unlimited calls and twenty gigabytes of data.",
    "I can switch you to it starting with your next billing cycle.",
    "The restaurant has a table for four at half past seven.",
    "Please keep your booking number handy in case you need to change it.",
    "Your refund was approved and will show up within five business days.",
    "I am sorry for the trouble, that should not have happened.",
    "The store on Main Street closes at nine on weekdays.",
    "I have added a note to your account so the next agent sees it.",
    "The technician can come by between noon and four.",
    "You will get a text message about thirty minutes before they arrive.",
    "Your password was reset, and the link expires in one hour.",
    "The package needs a signature, so someone should be home.",
    "I can also set a reminder for you the day before.",
    "Have a wonderful evening, and thanks for your patience.",
]


@dataclass
class Reply:
    """One reply as a client saw it."""

    protocol: str
    concurrency: int
    client: int
    index: int
    first_audio_ms: float | None = None  # after the first sentence's last word
    audio_bytes: int = 0
    error: str | None = None


def reply_sentences(client: int, index: int) -> list[str]:
    start = (client * 7 + index * 3) % len(POOL)
    return [POOL[(start + k) % len(POOL)] for k in range(3)]


def words_of(sentences: list[str]) -> list[tuple[str, bool]]:
    """The reply's words in order, each with whether it ends a sentence."""
    out = []
    for sentence in sentences:
        words = sentence.split(" ")
        out += [(w, i == len(words) - 1) for i, w in enumerate(words)]
    return out


# --------------------------------------------------------------------------- the three agents


class ElevenLabsAgent:
    """A multi-context socket; sentences sent whole as they complete (auto_mode)."""

    def __init__(self, url: str, key: str | None) -> None:
        self.url = (url.replace("http", "ws", 1) + "/v1/text-to-speech/default/multi-stream-input"
                    f"?output_format=pcm_{SAMPLE_RATE}&auto_mode=true&inactivity_timeout=180")
        self.headers = {"xi-api-key": key} if key else {}

    async def __aenter__(self):
        self.ws = await websockets.connect(self.url, additional_headers=self.headers, max_size=None)
        self.waiting: dict[str, tuple[asyncio.Future, asyncio.Future, list[int]]] = {}
        self.reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        self.reader.cancel()
        await self.ws.close()

    async def _read(self) -> None:
        async for raw in self.ws:
            message = json.loads(raw)
            entry = self.waiting.get(message.get("contextId"))
            if entry is None:
                continue
            first, final, size = entry
            if message.get("audio"):
                size[0] += len(base64.b64decode(message["audio"]))
                if not first.done():
                    first.set_result(time.perf_counter())
            if message.get("isFinal"):
                final.set_result(None)
            elif "error" in message and not final.done():
                final.set_exception(RuntimeError(message.get("message")))

    async def reply(self, sentences: list[str], word_s: float, record: Reply) -> None:
        context = uuid.uuid4().hex[:12]
        loop = asyncio.get_running_loop()
        first, final, size = loop.create_future(), loop.create_future(), [0]
        self.waiting[context] = (first, final, size)
        sentence_done_at = None
        buffer: list[str] = []
        for word, ends in words_of(sentences):
            await asyncio.sleep(word_s)
            buffer.append(word)
            if ends:
                await self.ws.send(json.dumps({"text": " ".join(buffer) + " ", "context_id": context}))
                buffer = []
                sentence_done_at = sentence_done_at or time.perf_counter()
        await self.ws.send(json.dumps({"context_id": context, "flush": True}))
        await self.ws.send(json.dumps({"context_id": context, "close_context": True}))
        await asyncio.wait_for(final, 300)
        del self.waiting[context]
        record.first_audio_ms = 1000 * (first.result() - sentence_done_at) if first.done() else None
        record.audio_bytes = size[0]


class StreamAgent:
    """A `/v1/audio/speech/stream` socket; words sent as they are written."""

    def __init__(self, url: str, key: str | None) -> None:
        self.url = url.replace("http", "ws", 1) + "/v1/audio/speech/stream"
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def __aenter__(self):
        self.ws = await websockets.connect(self.url, additional_headers=self.headers, max_size=None)
        await self.ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.ws.close()

    async def reply(self, sentences: list[str], word_s: float, record: Reply) -> None:
        sentence_done_at: list[float] = []

        async def write() -> None:
            for word, ends in words_of(sentences):
                await asyncio.sleep(word_s)
                await self.ws.send(json.dumps({"type": "input.text", "text": word + " "}))
                if ends and not sentence_done_at:
                    sentence_done_at.append(time.perf_counter())
            await self.ws.send(json.dumps({"type": "input.done"}))

        writer = asyncio.create_task(write())
        first = None
        while True:
            message = await asyncio.wait_for(self.ws.recv(), 300)
            if isinstance(message, bytes):
                record.audio_bytes += len(message)
                first = first or time.perf_counter()
                continue
            event = json.loads(message)
            if event["type"] == "error":
                raise RuntimeError(event["message"])
            if event["type"] == "session.done":
                break
        await writer
        record.first_audio_ms = 1000 * (first - sentence_done_at[0]) if first else None


class HttpAgent:
    """One request a sentence, sent as it completes, each after the previous one."""

    def __init__(self, url: str, key: str | None, client: httpx.AsyncClient) -> None:
        self.url, self.client = url + "/v1/audio/speech", client
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    async def reply(self, sentences: list[str], word_s: float, record: Reply) -> None:
        ready: asyncio.Queue = asyncio.Queue()

        async def write() -> None:
            buffer: list[str] = []
            for word, ends in words_of(sentences):
                await asyncio.sleep(word_s)
                buffer.append(word)
                if ends:
                    ready.put_nowait((" ".join(buffer), time.perf_counter()))
                    buffer = []

        writer = asyncio.create_task(write())
        for index in range(len(sentences)):
            text, done_at = await ready.get()
            body = {"input": text, "response_format": "pcm", "stream_format": "audio"}
            async with self.client.stream("POST", self.url, json=body, headers=self.headers) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                async for chunk in response.aiter_bytes():
                    if chunk and index == 0 and record.first_audio_ms is None:
                        record.first_audio_ms = 1000 * (time.perf_counter() - done_at)
                    record.audio_bytes += len(chunk)
        await writer


# --------------------------------------------------------------------------- passes


async def run_pass(url: str, key: str | None, protocol: str, concurrency: int, replies: int,
                   word_s: float) -> list[Reply]:
    """C clients, `replies` replies each, one protocol; every reply's record."""
    records: list[Reply] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        async def client(number: int) -> None:
            agent = {"elevenlabs": lambda: ElevenLabsAgent(url, key), "stream": lambda: StreamAgent(url, key),
                     "http": lambda: HttpAgent(url, key, http)}[protocol]()
            try:
                async with agent:
                    for index in range(replies):
                        record = Reply(protocol, concurrency, number, index)
                        records.append(record)
                        try:
                            await agent.reply(reply_sentences(number, index), word_s, record)
                        except Exception as exc:  # noqa: BLE001  (a failed reply is a figure)
                            record.error = f"{type(exc).__name__}: {exc}"[:300]
                            return
            except Exception as exc:  # noqa: BLE001  (the socket did not open)
                records.append(Reply(protocol, concurrency, number, -1, error=f"{type(exc).__name__}: {exc}"[:300]))

        await asyncio.gather(*(client(n) for n in range(concurrency)))
    return records


def summary(records: list[Reply]) -> dict:
    times = np.array([r.first_audio_ms for r in records if r.error is None and r.first_audio_ms is not None])
    row = {"replies": len(times), "failed": sum(r.error is not None for r in records),
           "audio_s": round(sum(r.audio_bytes for r in records) / (2 * SAMPLE_RATE), 1)}
    if len(times):
        row.update({f"p{q}_ms": round(float(np.percentile(times, q)), 1) for q in (50, 90, 99)})
        row["mean_ms"] = round(float(times.mean()), 1)
    return row


async def main_async(args) -> int:
    results = []
    if args.warmup:  # one reply of each protocol first: nothing in the server is cold when measured
        for protocol in args.protocols:
            await run_pass(args.url, args.key, protocol, 1, 1, args.word_ms / 1000)
    print("| protocol | C | replies | failed | first audio after the sentence p50 ms | p90 | p99 | mean |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for concurrency in levels_of(args):
        for protocol in args.protocols:
            records = await run_pass(args.url, args.key, protocol, concurrency, args.replies, args.word_ms / 1000)
            row = summary(records)
            results.append({"protocol": protocol, "concurrency": concurrency, **row,
                            "errors": sorted({r.error for r in records if r.error})[:5],
                            "records": [asdict(r) for r in records]})
            print(f"| {protocol} | {concurrency} | {row['replies']} | {row['failed']} | {row.get('p50_ms', '-')} | "
                  f"{row.get('p90_ms', '-')} | {row.get('p99_ms', '-')} | {row.get('mean_ms', '-')} |", flush=True)
            for error in results[-1]["errors"]:
                print(f"    failed: {error}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"url": args.url, "word_ms": args.word_ms, "replies": args.replies,
                       "sample_rate": SAMPLE_RATE, "runs": results}, out, indent=1)
    return 0 if all(r["failed"] == 0 for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", default=None, help="an API key of the server, if it has any")
    add_concurrency_option(parser, [1, 16, 64], "C agents")
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    parser.add_argument("--replies", type=int, default=4, help="replies per client")
    parser.add_argument("--word-ms", type=float, default=20.0, help="the LLM writes a word this often")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--json", default=None, help="write every reply's record here")
    args = parser.parse_args(argv)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
