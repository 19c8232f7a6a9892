"""Closed-loop streaming clients for `mossvox bench serve`, shaped like
`vllm bench serve --omni --backend openai-audio-speech --dataset-name seed-tts`.

Each of C clients posts its next prompt as soon as its previous response has ended: one
``POST /v1/audio/speech`` per prompt with ``stream_format=audio``, ``response_format=pcm``, the
reference clip as a ``data:audio/wav;base64,...`` URL in ``ref_audio`` and its transcript in
``ref_text``, and (for random weights, which never stop by themselves) a forced length
``forced_frames = min(cap, max(1, round(frames_per_char * len(input))))`` with
``max_new_tokens = cap``. Every body chunk's arrival time and size is recorded
(`api.bench_report.RequestResult`); a request succeeds only with HTTP 200, a complete body and
non-empty whole-sample PCM.

    results, wall_s = await run_pass(prompts, config, info, concurrency=8)
    runs = await run_sweep(prompts, config, [1, 16, 64], warmup=True)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
import sys
import time
from dataclasses import dataclass
from typing import Callable, TextIO

import httpx
import msgspec

from api.bench_dataset import Prompt
from api.bench_report import ProgressLine, RequestResult, summarize


@dataclass(frozen=True)
class ForcedLength:
    """The forced length sent with every request (random weights never stop by themselves)."""

    frames_per_char: float = 0.87
    max_new_tokens: int = 256

    def frames(self, text: str) -> int:
        return min(self.max_new_tokens, max(1, round(self.frames_per_char * len(text))))

    def describe(self) -> str:
        return (f"forced_frames = min({self.max_new_tokens}, max(1, round({self.frames_per_char} * "
                f"len(input)))) and max_new_tokens = {self.max_new_tokens} sent with every request")


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to send (``forced=None``: no forced length, the model stops by itself)."""

    url: str
    model: str | None = None
    api_key: str | None = None
    seed: int = 0
    forced: ForcedLength | None = ForcedLength()
    timeout_s: float = 600.0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class ServerInfo:
    """The served model and its PCM layout, from ``GET /v1/models``."""

    model: str
    sample_rate: int
    channels: int

    @property
    def bytes_per_s(self) -> int:
        return self.sample_rate * self.channels * 2  # s16le


async def server_info(config: ClientConfig) -> ServerInfo:
    """The model to request (``config.model`` or the first listed) and its rate and channels."""
    async with httpx.AsyncClient(base_url=config.url, headers=config.headers, timeout=30) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        cards = response.json()["data"]
    card = next((c for c in cards if c["id"] == config.model), None) if config.model else cards[0]
    if card is None:
        raise ValueError(f"model {config.model!r} is not served at {config.url} "
                         f"(served: {', '.join(c['id'] for c in cards)})")
    return ServerInfo(card["id"], int(card["sample_rate"]), int(card["channels"]))


def request_body(prompt: Prompt, index: int, config: ClientConfig, model: str) -> bytes:
    """The JSON body for one prompt; reads its reference clip (OSError if unreadable). The
    base64 clip (hundreds of KB, nothing to escape) is spliced in rather than JSON-encoded."""
    clip = base64.b64encode(prompt.prompt_wav.read_bytes())
    fields = {"model": model, "input": prompt.target_text, "response_format": "pcm",
              "stream_format": "audio", "ref_text": prompt.prompt_text,
              "seed": (config.seed + index) % 2**63}
    if config.forced is not None:
        fields["forced_frames"] = config.forced.frames(prompt.target_text)
        fields["max_new_tokens"] = config.forced.max_new_tokens
    return b"".join((msgspec.json.encode(fields)[:-1], b',"ref_audio":"data:audio/wav;base64,', clip, b'"}'))


async def _one_request(client: httpx.AsyncClient, prompt: Prompt, index: int, config: ClientConfig,
                       info: ServerInfo, pass_start: float) -> RequestResult:
    result = RequestResult(index, prompt.utt_id, len(prompt.target_text),
                           config.forced.frames(prompt.target_text) if config.forced else None)
    try:
        body = request_body(prompt, index, config, info.model)
    except OSError as exc:
        result.error = f"reference clip unreadable: {exc}"
        return result
    sent = time.perf_counter()
    result.start_s = sent - pass_start
    try:
        async with client.stream("POST", "/v1/audio/speech", content=body,
                                 headers={"Content-Type": "application/json"}) as response:
            result.status = response.status_code
            result.ref_cache = response.headers.get("x-ref-cache")
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            layout = (response.headers.get("x-audio-sample-rate"), response.headers.get("x-audio-channels"))
            if layout != (str(info.sample_rate), str(info.channels)):
                result.error = f"audio layout {layout} differs from /v1/models ({info.sample_rate}, {info.channels})"
                return result
            async for chunk in response.aiter_raw():
                if chunk:
                    result.chunk_at_s.append(time.perf_counter() - sent)
                    result.chunk_bytes.append(len(chunk))
        result.latency_s = time.perf_counter() - sent
    except (httpx.HTTPError, OSError) as exc:  # refused, reset, cut mid-body, timed out
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.audio_bytes = sum(result.chunk_bytes)
    result.audio_s = result.audio_bytes / info.bytes_per_s
    if not result.audio_bytes:
        result.error = "empty audio"
    elif result.audio_bytes % (2 * info.channels):
        result.error = f"{result.audio_bytes} bytes is not a whole number of {info.channels}-channel s16 samples"
    else:
        result.ttfa_s = result.chunk_at_s[0]
        result.ok = True
    return result


async def run_pass(prompts: list[Prompt], config: ClientConfig, info: ServerInfo, concurrency: int,
                   on_result: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """All prompts through ``concurrency`` closed-loop clients; (results in prompt order, wall
    seconds from the first send to the last response's end). Never raises for a failed request."""
    results: list[RequestResult | None] = [None] * len(prompts)
    queue = iter(enumerate(prompts))

    async def worker(client: httpx.AsyncClient) -> None:
        for index, prompt in queue:  # shared iterator: each prompt is taken once
            result = await _one_request(client, prompt, index, config, info, start)
            results[index] = result
            if on_result is not None:
                on_result(result)

    # One client with one keep-alive connection per closed-loop client, as C separate clients
    # would be: one pool of C connections costs O(C) per request event (httpcore scans its
    # connections), which made the client the bottleneck at C=64. The clients share one TLS
    # context and exist before the clock starts (loading CA certificates takes ~50 ms each).
    tls = ssl.create_default_context()
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=config.url, headers=config.headers, timeout=timeout, verify=tls,
            limits=httpx.Limits(max_connections=1))) for _ in range(max(1, min(concurrency, len(prompts))))]
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for client in clients))
        wall_s = time.perf_counter() - start
    return [r for r in results if r is not None], wall_s


async def run_sweep(prompts: list[Prompt], config: ClientConfig, concurrencies: list[int], *,
                    warmup: bool = True, progress: TextIO | None = sys.stderr,
                    info: ServerInfo | None = None, stop_on_failure: bool = True) -> list[dict]:
    """One run per concurrency (`api.bench_report.summarize` dicts): a full warm-up pass that is
    discarded (when ``warmup``), then the measured pass. Stops after a failed run unless told not to."""
    info = info or await server_info(config)
    runs = []
    for concurrency in concurrencies:
        warm = None
        if warmup:
            bar = ProgressLine(f"C={concurrency} warm-up", len(prompts), progress)
            results, wall_s = await run_pass(prompts, config, info, concurrency, lambda r: bar.update(r.ok))
            failed = [r for r in results if not r.ok]
            warm = {"wall_s": round(wall_s, 4), "num_requests": len(results), "num_failed": len(failed),
                    "errors": [f"{r.utt_id}: {r.error}" for r in failed[:10]]}
        bar = ProgressLine(f"C={concurrency} measure", len(prompts), progress)
        cpu = time.process_time()
        results, wall_s = await run_pass(prompts, config, info, concurrency, lambda r: bar.update(r.ok))
        runs.append(summarize(concurrency, results, wall_s, info.bytes_per_s, warmup=warm,
                              client_cpu_s=time.process_time() - cpu))
        if runs[-1]["failed"] and stop_on_failure:
            break
    return runs
