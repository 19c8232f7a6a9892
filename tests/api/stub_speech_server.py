"""A stub `/v1/audio/speech` that streams silence as fast as it can, to measure the bench client.

It answers like `mossvox serve` with the cpu profile (48 kHz stereo s16 PCM, a first chunk of one
80 ms frame, then chunks of 15 frames, ``forced_frames`` frames in all) but computes nothing, so
`mossvox bench serve` against it shows the client's own ceiling:

    python -m tests.api.stub_speech_server --port 8126 &
    mossvox bench serve --url http://127.0.0.1:8126 --num-prompts 256 --concurrency 16,64,128 --no-warmup
"""

from __future__ import annotations

import argparse
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

RATE, CHANNELS, FRAME_SAMPLES = 48000, 2, 3840
FRAME_BYTES = FRAME_SAMPLES * CHANNELS * 2


async def _speech(request: Request) -> StreamingResponse | JSONResponse:
    body = json.loads(await request.body())
    frames = int(body.get("forced_frames") or 50)
    if not body.get("input"):
        return JSONResponse({"error": {"message": "empty input"}}, status_code=400)

    async def chunks():
        yield bytes(FRAME_BYTES)
        left = frames - 1
        while left > 0:
            yield bytes(min(15, left) * FRAME_BYTES)
            left -= min(15, left)

    return StreamingResponse(chunks(), media_type="audio/pcm",
                             headers={"X-Audio-Sample-Rate": str(RATE), "X-Audio-Channels": str(CHANNELS)})


async def _models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": "stub", "sample_rate": RATE, "channels": CHANNELS}]})


def make_app() -> Starlette:
    return Starlette(routes=[Route("/v1/audio/speech", _speech, methods=["POST"]), Route("/v1/models", _models)])


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8126)
    args = parser.parse_args()
    print(f"stub serving on http://127.0.0.1:{args.port}", flush=True)
    uvicorn.run(make_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
