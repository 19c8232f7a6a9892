"""`mossvox bench serve --client-procs P`: the closed-loop clients spread over P processes, against
the stub speech server (it streams silence; ``forced_frames`` frames of 80 ms, HTTP 400 for an
empty input), so every request's audio length is known exactly."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from bench.client import (ClientConfig, ForcedLength, _run_pass, auto_client_procs, run_pass,
                              server_info)
from bench.dataset import Prompt, read_seed_tts
from bench.report import format_table, summarize
from cli.commands.bench_serve import _client_procs
from cli.main import main
from tests.api.helpers import tone_wav
from tests.api.server_process import stub_speech_server

FRAME_S = 0.08
FORCED = ForcedLength(0.25, 16)


class ExplodingClip(type(Path())):
    """A reference clip whose reading raises something `_one_request` does not catch (a bug in
    the client process), or ends the process outright."""

    def read_bytes(self) -> bytes:
        if self.name == "exit.wav":
            os._exit(3)
        raise RuntimeError("clip reader bug")


@pytest.fixture(scope="module")
def stub():
    with stub_speech_server() as url:
        yield url


@pytest.fixture(scope="module")
def seed_root(tmp_path_factory):
    """A Seed-TTS-format directory of 12 prompts over 3 short clips."""
    root = tmp_path_factory.mktemp("seed")
    (root / "en" / "wavs").mkdir(parents=True)
    for k in range(3):
        (root / "en" / "wavs" / f"c{k}.wav").write_bytes(tone_wav(1.0 + k, rate=24000, hz=180 + 40 * k))
    lines = [f"utt{i:02d}|A calm voice number {i % 3}.|wavs/c{i % 3}.wav|"
             f"{'Sentence ' * (1 + i % 5)}to speak, number {i}." for i in range(12)]
    (root / "en" / "meta.lst").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def _prompts(root: Path) -> list[Prompt]:
    return read_seed_tts(root)


def test_auto_client_procs_and_the_option():
    assert [auto_client_procs(c) for c in (1, 16, 32, 33, 64, 128, 129)] == [1, 1, 1, 2, 2, 4, 5]
    assert _client_procs("auto") is None and _client_procs("3") == 3
    with pytest.raises(Exception):
        _client_procs("0")


def test_two_processes_send_the_same_requests_as_one(stub, seed_root):
    prompts = _prompts(seed_root)
    config = ClientConfig(stub, forced=FORCED)
    info = asyncio.run(server_info(config))
    seen = []
    one = asyncio.run(_run_pass(prompts, config, info, 4, None, 1))
    two = asyncio.run(_run_pass(prompts, config, info, 4, seen.append, 2))
    assert one.procs == 1 and len(one.cpu_s) == 1
    assert two.procs == 2 and len(two.cpu_s) == 3 and all(c > 0 for c in two.cpu_s[1:])
    assert sorted(r.index for r in seen) == list(range(12))  # on_result, in this process

    def key(r):
        return r.index, r.utt_id, r.target_chars, r.forced_frames, r.audio_bytes, r.status

    assert [r.index for r in two.results] == list(range(12))
    assert [key(r) for r in two.results] == [key(r) for r in one.results]
    assert all(r.ok and r.error is None for r in two.results)
    for r in two.results:
        assert r.audio_s == pytest.approx(r.forced_frames * FRAME_S)
        assert r.audio_bytes == sum(r.chunk_bytes) and r.chunk_at_s == sorted(r.chunk_at_s)
        # send times rebased on the common clock: inside the pass
        assert 0 <= r.start_s and 0 < r.ttfa_s <= r.latency_s
        assert r.start_s + r.latency_s <= two.wall_s + 1e-6
    assert min(r.start_s for r in two.results) < 0.5

    run = summarize(4, two.results, two.wall_s, info.bytes_per_s, client_cpu_s=sum(two.cpu_s),
                    client_cpu_max_s=max(two.cpu_s), client_procs=two.procs)
    total = sum(r.audio_s for r in two.results)
    assert not run["failed"] and run["num_requests"] == 12 and run["num_failed"] == 0
    assert run["audio_s_per_s"] == pytest.approx(total / two.wall_s, rel=1e-3)
    assert run["client_procs"] == 2 and run["client_cpu_max_s"] <= run["client_cpu_s"]
    assert "(2 processes, " in format_table([run])


def test_cli_with_two_processes_reports_every_request(stub, seed_root, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--url", stub, "--dataset", str(seed_root), "--concurrency", "4",
               "--client-procs", "2", "--warmup", "--out", str(out),
               "--frames-per-char", "0.25", "--max-new-tokens", "16"])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    assert "| 4 | 12 | 0 |" in printed.out and "(2 processes, " in printed.out
    assert "C=4 warm-up" in printed.err and "C=4 measure" in printed.err and "12/12" in printed.err
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert doc["client_procs"] == 2 and run["client_procs"] == 2 and not doc["failed"]
    assert run["warmup"]["num_requests"] == 12 and run["warmup"]["num_failed"] == 0
    assert sorted(r["utt_id"] for r in run["requests"]) == [f"utt{i:02d}" for i in range(12)]
    for r in run["requests"]:
        assert r["forced_frames"] == min(16, max(1, round(0.25 * r["target_chars"])))
        assert r["audio_s"] == pytest.approx(r["forced_frames"] * FRAME_S)
        assert r["start_s"] + r["latency_s"] <= run["wall_s"] + 1e-4  # wall_s reported to 0.1 ms


def test_failed_requests_in_a_client_process_fail_the_run(stub, seed_root):
    prompts = _prompts(seed_root)
    # the stub answers an empty input with HTTP 400; a missing clip fails before sending
    prompts[3] = Prompt(prompts[3].utt_id, prompts[3].prompt_text, prompts[3].prompt_wav, "")
    prompts[8] = Prompt(prompts[8].utt_id, prompts[8].prompt_text, seed_root / "gone.wav", "Hello.")
    config = ClientConfig(stub, forced=FORCED)
    info = asyncio.run(server_info(config))
    results, wall_s = asyncio.run(run_pass(prompts, config, info, 4, client_procs=2))
    run = summarize(4, results, wall_s, info.bytes_per_s)
    assert run["failed"] and run["num_requests"] == 12 and run["num_failed"] == 2
    errors = {r.index: r.error for r in results if not r.ok}
    assert errors[3].startswith("HTTP 400") and "unreadable" in errors[8]
    assert results[8].start_s == 0.0  # never sent


def test_cli_exit_status_when_a_client_process_sees_failures(stub, seed_root, tmp_path, capsys):
    root = tmp_path / "seed"
    (root / "en").mkdir(parents=True)
    meta = (seed_root / "en" / "meta.lst").read_text().splitlines()
    meta = [line.replace("wavs/", str(seed_root / "en" / "wavs") + "/") for line in meta]
    meta[5] = "missing|Gone.|wavs/gone.wav|This clip does not exist."
    (root / "en" / "meta.lst").write_text("\n".join(meta) + "\n")
    rc = main(["bench", "serve", "--url", stub, "--dataset", str(root), "--concurrency", "4",
               "--client-procs", "2", "--no-progress", "--frames-per-char", "0.25", "--max-new-tokens", "16"])
    printed = capsys.readouterr().out
    assert rc == 1 and "RESULT: FAILED" in printed and "missing: reference clip unreadable" in printed


@pytest.mark.parametrize("clip", ["bug.wav", "exit.wav"])
def test_a_broken_client_process_fails_the_run(stub, seed_root, clip):
    """An exception the client does not expect, or a process that dies, fails the prompts it had
    (and only those: the other process carries on) instead of hanging or losing them silently."""
    prompts = _prompts(seed_root)
    prompts[5] = Prompt(prompts[5].utt_id, prompts[5].prompt_text, ExplodingClip(seed_root / clip), "Hi.")
    config = ClientConfig(stub, forced=FORCED)
    info = asyncio.run(server_info(config))
    results, wall_s = asyncio.run(run_pass(prompts, config, info, 4, client_procs=2))
    run = summarize(4, results, wall_s, info.bytes_per_s)
    assert run["failed"] and [r.index for r in results] == list(range(12))
    assert "client process" in results[5].error
    assert ("RuntimeError: clip reader bug" if clip == "bug.wav" else "exited with code 3") in results[5].error
    assert any(r.ok for r in results)
