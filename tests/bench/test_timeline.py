"""`python -m bench.timeline` over the timelines of a real engine (tiny demo model, CPU): a pass of
one request then two of the same voice; the figures count what the engine did. Then a real
server over HTTP: a request's time in its API process, from received to submit, in its parts."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest

from bench.timeline import main, split_passes, summarize
from engine.launcher import launch
from profiles import load_profile
from speech.job import SpeechJob
from stages.workers.timeline import read_events
from tests.api.helpers import data_url, tone_wav
from tests.api.server_process import ServerProcess
from tests.engine.conftest import collect, demo_model_dir  # noqa: F401 (a fixture)

FRAMES = (9, 7, 8)


@pytest.fixture(scope="module")
def timeline_dir(demo_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("timeline")
    voice = np.random.default_rng(3).integers(0, 64, size=(40, 12), dtype=np.int64)  # 40 reference frames

    async def run() -> None:
        handle = await launch(load_profile("cpu", [f"engine.timeline_dir={directory}"]), demo_model_dir, clients=1)
        try:
            client = handle.client(0)
            jobs = [SpeechJob(text=f"Sentence number {i} in one voice.", ref_codes=voice, forced_frames=n,
                              sampling={"seed": i}, received_at=time.monotonic())
                    for i, n in enumerate(FRAMES)]
            await collect(client, jobs[0])  # alone: its prompt blocks are named as they fill
            await asyncio.gather(*(collect(client, job) for job in jobs[1:]))  # then the voice is known
        finally:
            await handle.stop()

    asyncio.run(run())
    return directory


def test_a_pass_counts_frames_requests_and_cached_prompt_rows(timeline_dir, tmp_path, capsys):
    passes = [p for p in split_passes(read_events(timeline_dir), gap=30.0) if p]
    summary = summarize(max(passes, key=len))  # warm-up requests never reach the timeline
    talker, codec, life = summary["talker"], summary["codec"], summary["requests"]
    assert talker["frames"] == codec["frames"] == sum(FRAMES)
    # the CPU codec decodes each chunk length of a dispatch in one eager call
    assert codec["calls_per_dispatch"] == pytest.approx(codec["distinct_lengths_per_dispatch"])
    assert 1 <= codec["rows_per_call"] <= len(FRAMES)
    assert codec["padding_share"] == 0.0  # ... so no chunk was padded to another's length
    assert life["requests_done"] == len(FRAMES)
    # the voice's template and reference rows were computed once: the two later prompts took them
    assert talker["cached_prompt_tokens"] >= 2 * 32 and talker["prefill_tokens"] > 0
    # the engine client's side: every request's submit before its admission, its first and
    # final PCM after the codec decoded them
    for name in ("submit_to_admit_ms", "first_chunk_to_client_ms", "final_chunk_to_client_ms"):
        assert life[name]["n"] == len(FRAMES) and life[name]["p50"] >= 0, (name, life[name])
    # ... and around the engine: received (the job's arrival) to submit, and the first chunk on
    # the client's ring to taken by its request to handled (the request asked for the next one)
    for name in ("received_to_submit_ms", "first_chunk_in_client_to_taken_ms", "first_chunk_taken_to_out_ms"):
        assert life[name]["n"] == len(FRAMES) and life[name]["p50"] >= 0, (name, life[name])
    # the first request alone, then the two that came after it
    waves = summarize(max(passes, key=len), first_wave=1)
    assert waves["requests_first_wave"]["requests_done"] == 1
    assert waves["requests_later"]["requests_done"] == 2
    assert waves["requests_later"]["submit_to_admit_ms"]["n"] == 2
    # the CPU profile records no graph and compiles nothing while serving: no step stalled for one
    assert talker["graphs_recorded"] == 0 and talker["compiles"] == 0 and talker["triton_kernels"] == 0
    assert 0 <= talker["steps_over_100ms"] <= talker["steps"]
    assert "gpu_step_ms" not in talker  # on the CPU no step is timed by CUDA events
    host = talker["host_ms_per_step"]
    assert host["n"] == talker["steps"] and host["p50"] <= host["max"]
    assert main([str(timeline_dir), "--gap", "30", "--json", str(tmp_path / "t.json")]) == 0
    assert "cached_prompt_tokens" in capsys.readouterr().out
    assert json.loads((tmp_path / "t.json").read_text())[0]["talker"]["frames"] == sum(FRAMES)


def test_a_passs_opening_is_written_event_by_event(timeline_dir, tmp_path):
    """`--events`: each pass's first seconds as they happened, in time order, tagged by pass; a
    window as long as the pass holds every one of its events."""
    out = tmp_path / "events.jsonl"
    assert main([str(timeline_dir), "--gap", "30", "--events", str(out), "--events-s", "3600"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    (everything,) = [p for p in split_passes(read_events(timeline_dir), gap=30.0) if p]
    assert len(lines) == len(everything) and {e["pass"] for e in lines} == {0}
    assert [e["t"] for e in lines] == sorted(e["t"] for e in everything)
    assert sum(e["k"] == "client_submit" for e in lines) == len(FRAMES)
    assert main([str(timeline_dir), "--gap", "30", "--events", str(out), "--events-s", "0"]) == 0
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert 1 <= len(first) < len(lines) and first[0]["t"] == lines[0]["t"]


def test_padding_share_counts_the_frames_calls_padded():
    """Two dispatches: a 1-frame and a 15-frame chunk padded into one 15-frame call (14 of 30
    row-frames padding), then the same chunks cut into 1-frame rows of one call (none)."""
    def dispatch(t: float, calls: list) -> dict:
        # chunks: (rid, seq, frames, arrived, final, prime)
        return {"k": "codec_dispatch", "t": t, "dur": 0.01, "emit": 0.0, "n": 2, "calls": calls,
                "chunks": [[1, 0, 1, t, False, False], [2, 3, 15, t, False, False]]}

    padded = summarize([dispatch(0.0, [[2, 15]])])["codec"]
    assert padded["padding_share"] == pytest.approx(14 / 30)
    cut = summarize([dispatch(0.0, [[16, 1]])])["codec"]
    assert cut["padding_share"] == 0.0


def test_steps_timed_on_the_gpu_give_their_spans_and_the_idle_time_between_them():
    """Three talker steps the runner timed on the GPU (10 ms each; 0, 2 and 4 ms idle before
    them) and one iteration that read none back: the idle figures leave out the pass's first step
    (its wait for the first requests) and the untimed iteration."""
    def step(t: float, **gpu) -> dict:
        return {"k": "talker_step", "t": t, "dur": 0.009, "emit": 0.0, "drain": 0.0, "admit": 0.0,
                "batch": 4, "frames": 4, "prefill": 0, **gpu}

    one = [[0.010, 4, 0]]  # a step of 10 ms on the GPU, 4 decode rows
    events = [step(0.0, gpu_idle=0.5, gpu_steps=one), step(0.012, gpu_idle=0.002, gpu_steps=one),
              step(0.024), step(0.026, gpu_idle=0.004, gpu_steps=one)]
    talker = summarize(events)["talker"]
    assert talker["gpu_step_ms"]["n"] == 3 and talker["gpu_step_ms"]["mean"] == pytest.approx(10.0)
    assert talker["gpu_idle_ms_per_step"]["n"] == 2
    assert talker["gpu_idle_ms_per_step"]["mean"] == pytest.approx(3.0)
    window = 0.026 + 0.009
    assert talker["gpu_idle_share"] == pytest.approx(0.006 / window)
    assert talker["gpu_busy"] == pytest.approx(0.030 / window)


def test_the_gpu_spans_split_prefill_from_decoding_by_the_step_they_belong_to():
    """Steps timed on the GPU at 2 ms + 0.05 ms a decode row + 10 us a prompt token, read back
    one iteration late as one step ahead does (an iteration's own counts name the step it
    launched, not the one it read): the split and the fit come from each span's own counts."""
    def cost(rows: int, tokens: int) -> float:
        return (2.0 + 0.05 * rows + 0.010 * tokens) / 1e3

    steps = [(64, 0), (64, 700), (80, 0), (80, 0), (48, 300), (96, 1500), (96, 0), (70, 0)]
    events, t = [], 0.0
    for i, (rows, tokens) in enumerate(steps):
        done = steps[i - 1] if i else None  # the step read back in this iteration
        gpu = {} if done is None else {"gpu_idle": 0.0, "gpu_steps": [[cost(*done), *done]]}
        events.append({"k": "talker_step", "t": t, "dur": 0.02, "emit": 0.0, "drain": 0.0, "admit": 0.0,
                       "batch": rows, "frames": rows, "prefill": tokens, **gpu})
        t += 0.021
    talker = summarize(events)["talker"]
    read = steps[:-1]
    prefill = [cost(*s) * 1e3 for s in read if s[1]]
    decode_only = [cost(*s) * 1e3 for s in read if not s[1]]
    assert talker["gpu_prefill_step_ms"]["n"] == 3
    assert talker["gpu_prefill_step_ms"]["mean"] == pytest.approx(sum(prefill) / 3)
    assert talker["gpu_decode_only_step_ms"]["mean"] == pytest.approx(sum(decode_only) / len(decode_only))
    fit = talker["gpu_step_fit"]
    assert fit["fixed_ms"] == pytest.approx(2.0) and fit["ms_per_decode_row"] == pytest.approx(0.05)
    assert fit["us_per_prompt_token"] == pytest.approx(10.0)
    # steps that never prefill leave the prompt token's cost unknown: no fit
    flat = [e | {"gpu_steps": [[s[0], s[1], 0] for s in e["gpu_steps"]]} for e in events if "gpu_steps" in e]
    assert "gpu_step_fit" not in summarize(flat)["talker"]


def test_over_http_the_api_process_marks_the_body_and_the_voice_before_submit(tmp_path):
    """A request with an inline reference clip, twice (a miss, then a hit), through the real server:
    each request's received -> parsed -> voice -> submit parts are all there, in order, and add
    up to its received -> submit, and the clip's one encode is in the codec's figures."""
    timelines = tmp_path / "timelines"
    server = ServerProcess(tmp_path / "data", sets=(f"engine.timeline_dir={timelines}",)).start()
    try:
        body = {"model": "mossvox", "input": "Marks before the engine.", "response_format": "pcm",
                "ref_audio": data_url(tone_wav(2.0))}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for _ in range(2):
                response = http.post("/v1/audio/speech", json=body)
                assert response.status_code == 200 and response.content
    finally:
        server.stop()
    summary = summarize(read_events(timelines))
    life = summary["requests"]
    # the clip was encoded once, in one batch of one (the second request's voice was a cache hit)
    encode = summary["encode"]
    assert (encode["batches"], encode["clips"]) == (1, 1)
    assert encode["ms_per_clip"] == pytest.approx(encode["batch_ms"]["mean"]) and 0 < encode["busy"] <= 1
    # its way: queued in the codec loop, handed to the encoder thread, encoded, all inside the
    # API process's round trip; nothing else was waiting
    assert encode["left_waiting"] == 0 and encode["queued_ms_per_clip"] >= 0
    assert encode["round_trip_ms"]["n"] == 1
    assert (encode["queued_ms_per_clip"] + encode["handed_ms"]["mean"] + encode["batch_ms"]["mean"]
            <= encode["round_trip_ms"]["mean"])
    for name in ("received_to_parsed_ms", "parsed_to_voice_ms", "voice_to_submit_ms", "received_to_submit_ms"):
        assert life[name]["n"] == 2 and life[name]["p50"] >= 0, (name, life[name])
    parts = sum(life[name]["mean"] for name in ("received_to_parsed_ms", "parsed_to_voice_ms", "voice_to_submit_ms"))
    assert parts == pytest.approx(life["received_to_submit_ms"]["mean"], rel=1e-6)
    # parsed -> voice in two: the clip fetched and decoded, then its codes (the miss's encode)
    halves = life["parsed_to_loaded_ms"]["mean"] + life["loaded_to_voice_ms"]["mean"]
    assert life["loaded_to_voice_ms"]["n"] == 2 and halves == pytest.approx(life["parsed_to_voice_ms"]["mean"], rel=1e-6)
    assert life["loaded_to_voice_ms"]["max"] >= encode["round_trip_ms"]["mean"]
