"""A streaming text-input TTS client written the way vLLM-Omni's documented WebSocket protocol
(`/v1/audio/speech/stream`) is used by its clients: nothing in it knows about mossvox.

It sends `session.config` (the speech request's fields plus `split_granularity` and
`stream_audio`), each text as `input.text` messages (word by word with --simulate-stt), then
`input.done`; it collects binary frames between `audio.start` and `audio.done`, one file per
sentence, until `session.done`, for every text over the same connection; then `session.close`.
It prints one JSON line per saved file and exits non-zero on an `error` event.

    python vllm_omni_stream_client.py --url ws://127.0.0.1:8000/v1/audio/speech/stream \\
        --text "Hello world. How are you?" --text "Second utterance." --response-format pcm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import websockets


async def send_utterance(ws, text: str, simulate_stt: bool, delay: float) -> None:
    if simulate_stt:
        words = text.split(" ")
        for i, word in enumerate(words):
            await ws.send(json.dumps({"type": "input.text", "text": word + (" " if i < len(words) - 1 else "")}))
            await asyncio.sleep(delay)
    else:
        await ws.send(json.dumps({"type": "input.text", "text": text}))
    await ws.send(json.dumps({"type": "input.done"}))


async def receive_utterance(ws, output_dir: str, fmt: str) -> tuple[list[dict], bool]:
    saved, chunks, failed = [], [], False
    while True:
        message = await ws.recv()
        if isinstance(message, bytes):
            chunks.append(message)
            continue
        msg = json.loads(message)
        kind = msg.get("type")
        if kind == "audio.start":
            chunks = []
        elif kind == "audio.done":
            name = f"utterance_{msg['utterance_index']:03d}_sentence_{msg['sentence_index']:03d}.{fmt}"
            data = b"".join(chunks)
            with open(os.path.join(output_dir, name), "wb") as f:
                f.write(data)
            saved.append({"file": name, "bytes": len(data), "total_bytes": msg.get("total_bytes"),
                          "error": msg.get("error", False)})
        elif kind == "session.done":
            return saved, failed
        elif kind == "error":
            print(f"ERROR: {msg['message']}", file=sys.stderr)
            failed = True


async def main(args: argparse.Namespace) -> int:
    os.makedirs(args.output_dir, exist_ok=True)
    config = {"type": "session.config", "response_format": args.response_format,
              "stream_audio": args.stream_audio}
    for key in ("model", "voice", "language", "split_granularity", "seed"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    failed = False
    async with websockets.connect(args.url, max_size=None) as ws:
        await ws.send(json.dumps(config))
        for text in args.text:
            sender = asyncio.create_task(send_utterance(ws, text, args.simulate_stt, args.stt_delay))
            try:
                saved, bad = await receive_utterance(ws, args.output_dir, args.response_format)
            finally:
                sender.cancel()
            failed = failed or bad
            for item in saved:
                print(json.dumps(item))
        await ws.send(json.dumps({"type": "session.close"}))
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Streaming text-input TTS client")
    parser.add_argument("--url", default="ws://localhost:8000/v1/audio/speech/stream")
    parser.add_argument("--text", required=True, action="append")
    parser.add_argument("--output-dir", default="streaming_tts_output")
    parser.add_argument("--model")
    parser.add_argument("--voice")
    parser.add_argument("--language")
    parser.add_argument("--response-format", default="wav")
    parser.add_argument("--stream-audio", action="store_true")
    parser.add_argument("--split-granularity", choices=["none", "sentence", "clause"])
    parser.add_argument("--seed", type=int)
    parser.add_argument("--simulate-stt", action="store_true")
    parser.add_argument("--stt-delay", type=float, default=0.05)
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
