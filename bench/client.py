"""Closed-loop streaming clients for `mossvox bench serve`, shaped like
`vllm bench serve --omni --backend openai-audio-speech --dataset-name seed-tts`.

Each of C clients posts its next prompt as soon as its previous response has ended: one
``POST /v1/audio/speech`` per prompt with ``stream_format=audio``, ``response_format=pcm`` in the
model's own layout (``sample_rate`` and ``channels`` from ``GET /v1/models``), the prompt's fields
(the reference clip as a ``data:audio/wav;base64,...`` URL in ``ref_audio`` and its transcript in
``ref_text``; a voice description in ``instructions``: whichever the prompt has), and (for random
weights, whose stop head fires at random) a forced length
``forced_frames = min(cap, max(1, round(frames_per_char * len(input))))`` with
``max_new_tokens = cap``. Every body chunk's arrival time and size is recorded
(`bench.report.RequestResult`), with the fields the server says it ignored
(``X-Ignored-Fields``: MOSS-TTS-Realtime has no use for ``ref_text``); a request succeeds only
with HTTP 200, a complete body and non-empty whole-sample PCM.

At high concurrency one Python process cannot keep up with the streams (it measured its own
ceiling, not the server's), so the C clients can be spread over P worker processes
(``client_procs``; `auto_client_procs`: ceil(C / 32)). Each process runs its own asyncio loop and
its own httpx clients, exactly as the single process does; they start together on one signal. The
assignment of prompts is the same closed loop for any P: one counter shared by all processes hands
out the prompts in order, and a client takes the next untaken prompt as soon as its previous
response has ended (which client sends which prompt depends on timing, for P = 1 as for P > 1; a
prompt's request body, seed and forced length depend only on its index, so they are identical).
The parent merges the per-request records and computes every figure as for one process: the wall
time runs from the earliest start in any process to the latest end in any process.

    results, wall_s = await run_pass(prompts, config, info, concurrency=8)
    results, wall_s = await run_pass(prompts, config, info, concurrency=128, client_procs=4)
    runs = await run_sweep(prompts, config, [1, 16, 64], warmup=True, voices="new")

By default every pass sends each reference clip as a recording the server has never heard
(`bench.voices`: the peers' protocol, and a cloning service's normal day: the reference-code and
prefix caches cannot help); ``voices="known"`` sends the clips as they are.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import secrets
import ssl
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable, TextIO

import httpx
import msgspec

from bench.dataset import Prompt
from bench.report import ProgressLine, RequestResult, summarize
from bench.voices import new_voice


@dataclass(frozen=True)
class ForcedLength:
    """The forced length sent with every request (random weights stop at random)."""

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
    voice_salt: int | None = None  # a pass's: every reference clip sent as a new recording (`bench.voices`)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class ServerInfo:
    """The served model and its PCM layout, from ``GET /v1/models`` (``root``: the model family's
    own name, e.g. moss-sound-effect, when the server lists it)."""

    model: str
    sample_rate: int
    channels: int
    root: str | None = None

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
    return ServerInfo(card["id"], int(card["sample_rate"]), int(card["channels"]), card.get("root"))


def request_body(prompt: Prompt, index: int, config: ClientConfig, info: ServerInfo) -> bytes:
    """The JSON body for one prompt; reads its reference clip, if it has one (OSError if
    unreadable). The PCM layout asked for is the model's own (the server's pcm default is OpenAI's
    24 kHz mono), so the figures measure the native stream. The base64 clip (hundreds of KB,
    nothing to escape) is spliced in rather than JSON-encoded."""
    fields = {"model": info.model, "input": prompt.target_text, "response_format": "pcm",
              "sample_rate": info.sample_rate, "channels": info.channels,
              "stream_format": "audio", "seed": (config.seed + index) % 2**63}
    if prompt.prompt_text:
        fields["ref_text"] = prompt.prompt_text
    if prompt.instructions:
        fields["instructions"] = prompt.instructions
    if config.forced is not None:
        fields["forced_frames"] = config.forced.frames(prompt.target_text)
        fields["max_new_tokens"] = config.forced.max_new_tokens
    if prompt.prompt_wav is None:
        return msgspec.json.encode(fields)
    wav = prompt.prompt_wav.read_bytes()
    if config.voice_salt is not None:
        wav = new_voice(wav, config.voice_salt, index)
    clip = base64.b64encode(wav)
    return b"".join((msgspec.json.encode(fields)[:-1], b',"ref_audio":"data:audio/wav;base64,', clip, b'"}'))


async def _one_request(client: httpx.AsyncClient, prompt: Prompt, index: int, config: ClientConfig,
                       info: ServerInfo, pass_start: float) -> RequestResult:
    result = RequestResult(index, prompt.utt_id, len(prompt.target_text),
                           config.forced.frames(prompt.target_text) if config.forced else None)
    try:
        body = request_body(prompt, index, config, info)
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
            result.ignored_fields = response.headers.get("x-ignored-fields")
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


CLIENTS_PER_PROC = 32


def auto_client_procs(concurrency: int) -> int:
    """The default number of client processes: ceil(C / 32), at least 1 (measured: one process
    carries a few dozen streams before its own CPU becomes the limit)."""
    return max(1, math.ceil(concurrency / CLIENTS_PER_PROC))


@dataclass
class PassOutcome:
    """One pass: results in prompt order, wall seconds (first start to last end in any process),
    the number of client processes, and each process's CPU seconds over the pass (with P > 1 the
    parent, which only merges, counts as one more)."""

    results: list[RequestResult]
    wall_s: float
    procs: int = 1
    cpu_s: list[float] = field(default_factory=list)


async def _make_clients(stack: contextlib.AsyncExitStack, config: ClientConfig,
                        count: int) -> list[httpx.AsyncClient]:
    # One client with one keep-alive connection per closed-loop client, as C separate clients
    # would be: one pool of C connections costs O(C) per request event (httpcore scans its
    # connections), which made the client the bottleneck at C=64. The clients share one TLS
    # context and exist before the clock starts (loading CA certificates takes ~50 ms each).
    tls = ssl.create_default_context()
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    return [await stack.enter_async_context(httpx.AsyncClient(
        base_url=config.url, headers=config.headers, timeout=timeout, verify=tls,
        limits=httpx.Limits(max_connections=1))) for _ in range(count)]


async def run_pass(prompts: list[Prompt], config: ClientConfig, info: ServerInfo, concurrency: int,
                   on_result: Callable[[RequestResult], None] | None = None, *,
                   client_procs: int = 1) -> tuple[list[RequestResult], float]:
    """All prompts through ``concurrency`` closed-loop clients, spread over ``client_procs``
    processes; (results in prompt order, wall seconds from the first start to the last response's
    end). ``on_result`` is called in this process as each result arrives. Never raises for a
    failed request.

    With ``client_procs`` > 1 the processes are started with multiprocessing's ``spawn``, which
    imports the main module again in each: a script calling this needs the usual
    ``if __name__ == "__main__":`` guard (the ``mossvox`` command has it); without it the client
    processes die while starting and the pass fails."""
    outcome = await _run_pass(prompts, config, info, concurrency, on_result, client_procs)
    return outcome.results, outcome.wall_s


async def _run_pass(prompts: list[Prompt], config: ClientConfig, info: ServerInfo, concurrency: int,
                    on_result: Callable[[RequestResult], None] | None, client_procs: int) -> PassOutcome:
    clients = max(1, min(concurrency, len(prompts)))
    procs = max(1, min(client_procs, clients))
    if procs == 1:
        cpu = time.process_time()
        results, wall_s = await _run_in_process(prompts, config, info, clients, on_result)
        return PassOutcome(results, wall_s, 1, [time.process_time() - cpu])
    return await _run_in_processes(prompts, config, info, clients, procs, on_result)


async def _run_in_process(prompts: list[Prompt], config: ClientConfig, info: ServerInfo, clients: int,
                          on_result: Callable[[RequestResult], None] | None) -> tuple[list[RequestResult], float]:
    """The single-process pass (``client_procs=1``)."""
    results: list[RequestResult | None] = [None] * len(prompts)
    queue = iter(enumerate(prompts))

    async def worker(client: httpx.AsyncClient) -> None:
        for index, prompt in queue:  # shared iterator: each prompt is taken once
            result = await _one_request(client, prompt, index, config, info, start)
            results[index] = result
            if on_result is not None:
                on_result(result)

    async with contextlib.AsyncExitStack() as stack:
        http = await _make_clients(stack, config, clients)
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for client in http))
        wall_s = time.perf_counter() - start
    return [r for r in results if r is not None], wall_s


# Times crossing processes are absolute time.perf_counter() readings: on Linux it is
# CLOCK_MONOTONIC (as time.monotonic), one clock for the whole system, so a send in one process and
# a last byte in another are on the same time line (likewise on macOS and Windows).


def _child_main(payload: str, clients: int, counter, go, messages) -> None:
    """One client process: ``clients`` closed-loop clients taking prompt indices from the shared
    ``counter``; sends on its own pipe ``messages`` ("ready",), each ("result", RequestResult) with
    ``start_s`` an absolute perf_counter time, then ("done", start, end, cpu seconds) or ("error",
    text, traceback). One pipe per process, written by its event loop thread only: a process that
    dies mid-write can break no other process's channel (a shared multiprocessing.Queue's write
    lock would be left held)."""
    cpu = time.process_time()
    try:
        with open(payload, "rb") as f:
            prompts, config, info = pickle.load(f)
        start, end = asyncio.run(_child_pass(prompts, config, info, clients, counter, go, messages))
        messages.send(("done", start, end, time.process_time() - cpu))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        with contextlib.suppress(OSError):
            messages.send(("error", f"{type(exc).__name__}: {exc}",
                           "".join(traceback.format_exception(exc))[-2000:]))
    finally:
        messages.close()


def _take(counter, total: int) -> int | None:
    with counter.get_lock():  # held for a read and a write: no contention worth measuring
        index = counter.value
        if index >= total:
            return None
        counter.value = index + 1
    return index


async def _child_pass(prompts, config, info, clients, counter, go, messages) -> tuple[float, float]:
    async def worker(client: httpx.AsyncClient) -> None:
        while (index := _take(counter, len(prompts))) is not None:
            result = await _one_request(client, prompts[index], index, config, info, 0.0)
            messages.send(("result", result))  # a few KB into a pipe the parent keeps draining

    async with contextlib.AsyncExitStack() as stack:
        http = await _make_clients(stack, config, clients)
        messages.send(("ready",))
        # the common start signal (blocking: nothing else runs on this loop yet)
        while not go.wait(1.0):
            if not multiprocessing.parent_process().is_alive():
                raise RuntimeError("the parent process is gone")
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for client in http))
        end = time.perf_counter()
    return start, end


async def _run_in_processes(prompts: list[Prompt], config: ClientConfig, info: ServerInfo, clients: int,
                            procs: int, on_result: Callable[[RequestResult], None] | None) -> PassOutcome:
    """The pass over ``procs`` spawned processes (spawn: no inherited event loop, threads or
    locks), ``clients`` split as evenly as possible; every figure from the merged records."""
    cpu = time.process_time()
    ctx = multiprocessing.get_context("spawn")
    counter, go = ctx.Value("q", 0), ctx.Event()
    # The prompts go through a file, not the spawn pipe: CPython's spawn writes a process's
    # arguments into a pipe whose read end the parent keeps open, so a child that dies while
    # starting (say, a script without an `if __name__ == "__main__"` guard) would leave the parent
    # blocked forever on anything over the pipe's 64 KB.
    with tempfile.NamedTemporaryFile("wb", prefix="mossvox-bench-", suffix=".pickle", delete=False) as f:
        pickle.dump((prompts, config, info), f, protocol=pickle.HIGHEST_PROTOCOL)
        payload = f.name
    shares = [clients // procs + (k < clients % procs) for k in range(procs)]
    pipes = [ctx.Pipe(duplex=False) for _ in range(procs)]  # (parent reads, child writes)
    workers = [ctx.Process(target=_child_main, name=f"bench-client-{k}", daemon=True,
                           args=(payload, shares[k], counter, go, pipes[k][1]))
               for k in range(procs)]
    results: list[RequestResult | None] = [None] * len(prompts)
    starts, ends, cpus, lost = {}, {}, {}, {}
    try:
        for w, (_, child_end) in zip(workers, pipes):
            w.start()
            child_end.close()  # the child's copy is its only one: its exit reads as EOF here
        which = {reader: k for k, (reader, _) in enumerate(pipes)}
        ready: set[int] = set()
        while which:
            for reader in await asyncio.to_thread(multiprocessing.connection.wait, list(which), 0.5):
                k = which[reader]
                try:
                    message = reader.recv()
                except EOFError:  # it ended without "done" or "error": died (killed, os._exit, ...)
                    del which[reader]
                    workers[k].join(5)
                    lost[k] = f"exited with code {workers[k].exitcode} without reporting"
                    continue
                kind = message[0]
                if kind == "ready":
                    ready.add(k)
                elif kind == "result":
                    result = message[1]
                    results[result.index] = result
                    if on_result is not None:
                        on_result(result)
                elif kind == "done":
                    _, starts[k], ends[k], cpus[k] = message
                    del which[reader]
                else:  # "error": an exception the client did not expect; its process has ended
                    _, text, trace = message
                    del which[reader]
                    lost[k] = f"failed: {text}"
                    print(f"bench client process {k} failed:\n{trace}", file=sys.stderr)
            if len(ready | lost.keys()) == procs and not go.is_set():
                go.set()  # every process has its clients: start the clock everywhere at once
        for w in workers:
            w.join(10)
    finally:
        go.set()
        for w in workers:
            if w.is_alive():
                w.terminate()
                w.join(5)
        for reader, _ in pipes:
            reader.close()
        with contextlib.suppress(OSError):
            os.unlink(payload)
    # the pass's clock: the earliest start (just before the first send) to the latest end
    # (no process finished: from the first send seen, a wall of 0, and the run fails below)
    t0 = min(starts.values(), default=min((r.start_s for r in results if r and r.start_s), default=0.0))
    t1 = max(ends.values(), default=t0)
    for r in results:
        if r is not None and r.start_s:  # 0.0: never sent (unreadable clip), as with one process
            r.start_s -= t0
    if lost:  # prompts a lost process took (or nobody took) fail the run, as an exception would
        why = "; ".join(f"client process {k} {text}" for k, text in sorted(lost.items()))
        for index, prompt in enumerate(prompts):
            if results[index] is None:
                results[index] = RequestResult(
                    index, prompt.utt_id, len(prompt.target_text),
                    config.forced.frames(prompt.target_text) if config.forced else None, error=why)
    # the parent (merging only), then each process (a lost one reads 0)
    cpu_s = [time.process_time() - cpu] + [cpus.get(k, 0.0) for k in range(procs)]
    return PassOutcome([r for r in results if r is not None], t1 - t0, procs, cpu_s)


async def run_sweep(prompts: list[Prompt], config: ClientConfig, concurrencies: list[int], *,
                    warmup: bool = True, progress: TextIO | None = sys.stderr,
                    info: ServerInfo | None = None, stop_on_failure: bool = True,
                    client_procs: int | None = None, voices: str = "new") -> list[dict]:
    """One run per concurrency (`bench.report.summarize` dicts): a full warm-up pass that is
    discarded (when ``warmup``), then the measured pass, both through the same number of client
    processes (``client_procs``; None: `auto_client_procs` of each concurrency). ``voices``:
    "new", every pass (the warm-up too) sends each reference clip as a recording the server has
    never heard (`bench.voices`); "known", the clips as they are (after a warm-up pass of the same
    prompts, known to the server). Stops after a failed run unless told not to."""
    if voices not in ("new", "known"):
        raise ValueError(f"voices {voices!r}: new or known")
    info = info or await server_info(config)

    def pass_config() -> ClientConfig:
        return replace(config, voice_salt=secrets.randbits(62)) if voices == "new" else config

    runs = []
    for concurrency in concurrencies:
        procs = client_procs if client_procs is not None else auto_client_procs(concurrency)
        warm = None
        if warmup:
            bar = ProgressLine(f"C={concurrency} warm-up", len(prompts), progress)
            outcome = await _run_pass(prompts, pass_config(), info, concurrency, lambda r: bar.update(r.ok), procs)
            failed = [r for r in outcome.results if not r.ok]
            warm = {"wall_s": round(outcome.wall_s, 4), "num_requests": len(outcome.results),
                    "num_failed": len(failed), "errors": [f"{r.utt_id}: {r.error}" for r in failed[:10]]}
        bar = ProgressLine(f"C={concurrency} measure", len(prompts), progress)
        outcome = await _run_pass(prompts, pass_config(), info, concurrency, lambda r: bar.update(r.ok), procs)
        runs.append(summarize(concurrency, outcome.results, outcome.wall_s, info.bytes_per_s, warmup=warm,
                              client_cpu_s=sum(outcome.cpu_s), client_cpu_max_s=max(outcome.cpu_s),
                              client_procs=outcome.procs))
        if runs[-1]["failed"] and stop_on_failure:
            break
    return runs
