"""`mossvox bench serve` against a real `mossvox serve` on loopback (tiny demo model, cpu profile).

The demo model's weights are random, so its lengths are forced: every request's audio length is
known exactly (forced_frames * 80 ms), which lets these tests check the client's accounting.
"""

from __future__ import annotations

import asyncio
import json
import threading
import wave

import pytest

from bench.client import ClientConfig, ForcedLength, ServerInfo, request_body, run_pass, server_info
from bench.dataset import DatasetError, SyntheticEn1088, digest, read_seed_tts, select_prompts
from bench.prompt_sets import load_dataset
from bench.report import (RequestResult, after_first_wave, format_table, full_load, simulate_player,
                          summarize)
from cli.main import main
from tests.api.helpers import tone_wav
from tests.api.server_process import ServerProcess, stub_speech_server

FRAME_S = 0.08
KEY = "bench-key"
# short forced lengths keep each request near one second of audio (two chunks), so a run is quick
FAST = ["--frames-per-char", "0.25", "--max-new-tokens", "16"]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """One synthetic-en1088 cache for the module, so each clip is rendered once."""
    return tmp_path_factory.mktemp("clips")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-key", KEY).start()
    yield s
    s.stop()


def _write_seed_tts(root, rows):
    """rows: (utt_id, prompt_text, wav name, target_text, wav bytes or None)."""
    (root / "en" / "wavs").mkdir(parents=True)
    lines = []
    for utt, text, name, target, data in rows:
        if data is not None:
            (root / "en" / "wavs" / name).write_bytes(data)
        lines.append(f"{utt}|{text}|wavs/{name}|{target}")
    (root / "en" / "meta.lst").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_synthetic_dataset_has_the_stated_shape_and_is_deterministic(tmp_path):
    a, b = SyntheticEn1088(tmp_path / "a"), SyntheticEn1088(tmp_path / "b")
    assert digest(a.prompts) == digest(b.prompts)
    assert len(a.prompts) == 1088
    assert len({p.prompt_wav for p in a.prompts}) == 666 == len(a.clips)
    assert all(3.0 <= c.seconds <= 8.0 and c.transcript for c in a.clips)
    mean_chars = sum(len(p.target_text) for p in a.prompts) / len(a.prompts)
    assert 61 <= mean_chars <= 65
    assert 4.2 <= mean_chars * 0.87 * FRAME_S <= 4.6  # ~4.4 s of audio per request, as Seed-TTS EN

    some = select_prompts(a.prompts, 3, seed=5)
    assert some == select_prompts(a.prompts, 3, seed=5) != select_prompts(a.prompts, 3, seed=6)
    later = select_prompts(a.prompts, 6, seed=5)
    shifted = select_prompts(a.prompts, 3, seed=5, text_shift=3)  # known voices, the next 3 texts
    assert [(p.utt_id, p.prompt_wav, p.prompt_text) for p in shifted] == [(p.utt_id, p.prompt_wav, p.prompt_text)
                                                                         for p in some]
    assert [p.target_text for p in shifted] == [p.target_text for p in later[3:]]
    a.prepare(some)
    b.prepare(select_prompts(b.prompts, 3, seed=5))
    for p in some:
        other = b.root / p.prompt_wav.relative_to(a.root)
        assert p.prompt_wav.read_bytes() == other.read_bytes()
        with wave.open(str(p.prompt_wav)) as w:
            seconds = w.getnframes() / w.getframerate()
            assert w.getframerate() in (24000, 48000)
        clip = next(c for c in a.clips if c.name == p.prompt_wav.name)
        assert seconds == pytest.approx(clip.seconds, abs=1e-3)
        assert clip.transcript == p.prompt_text

    stamps = [p.prompt_wav.stat().st_mtime_ns for p in some]
    SyntheticEn1088(tmp_path / "a").prepare(some)  # made once: a second run writes nothing
    assert [p.prompt_wav.stat().st_mtime_ns for p in some] == stamps
    assert read_seed_tts(a.root) == a.prompts  # the cache folder is a Seed-TTS-format directory


def test_seed_tts_directory_is_read_and_bad_lines_are_named(tmp_path):
    root = tmp_path / "seed"
    _write_seed_tts(root, [("u1", "Prompt one.", "a.wav", "Target one.", b"x"),
                           ("u2", "Prompt two.", "b.wav", "Target two.", b"y")])
    meta = root / "en" / "meta.lst"
    meta.write_text(meta.read_text() + "\nu3|Prompt three.|wavs/c.wav|Target three.|extra\n")
    prompts = load_dataset(str(root)).prompts
    assert [(p.utt_id, p.prompt_text, p.target_text) for p in prompts] == [
        ("u1", "Prompt one.", "Target one."), ("u2", "Prompt two.", "Target two."),
        ("u3", "Prompt three.", "Target three.")]
    assert prompts[0].prompt_wav == root / "en" / "wavs" / "a.wav"

    meta.write_text("u1|Prompt one.|wavs/a.wav|Target one.\nu2|only three|fields\n")
    with pytest.raises(DatasetError, match=r"meta\.lst:2:"):
        read_seed_tts(root)
    with pytest.raises(DatasetError, match="meta.lst"):
        read_seed_tts(tmp_path / "nothing-here")


def test_models_without_clips_get_prompts_in_their_own_fields(tmp_path):
    sound = load_dataset("auto", tmp_path, model="moss-sound-effect")
    voice = load_dataset("auto", tmp_path, model="moss-voice-generator")
    assert (sound.name, voice.name) == ("synthetic-sound-effect", "synthetic-voice-design")
    assert load_dataset("auto", tmp_path, model="moss-tts-realtime").name == "synthetic-en1088"
    en = SyntheticEn1088(tmp_path)
    # the same amount of text per prompt as synthetic-en1088 (voice design speaks its very texts)
    assert [p.target_text for p in voice.prompts] == [p.target_text for p in en.prompts]
    assert len(sound.prompts) == 1088 and 58 <= sum(len(p.target_text) for p in sound.prompts) / 1088 <= 68
    assert digest(sound.prompts) == digest(load_dataset("synthetic-sound-effect").prompts)  # deterministic
    config = ClientConfig("http://127.0.0.1:1", forced=ForcedLength(0.25, 16))
    en.prepare(en.prompts[:1])
    for prompts, wanted in ((sound.prompts, set()), (voice.prompts, {"instructions"}),
                            (en.prompts, {"ref_audio", "ref_text"})):
        body = json.loads(request_body(prompts[0], 0, config, ServerInfo("mossvox", 24000, 1)))
        assert body["input"] == prompts[0].target_text and body["forced_frames"] >= 1
        assert {"ref_audio", "ref_text", "instructions"} & set(body) == wanted
    assert all(p.instructions and p.prompt_wav is None for p in voice.prompts)


def test_player_simulation_counts_stalls():
    bytes_per_s = 1000.0
    # 1 s of audio at t=0, the next second arrives at t=1.5: a 0.5 s stall
    stats = simulate_player([0.0, 1.5], [1000, 1000], bytes_per_s)
    assert stats.underrun_s == pytest.approx(0.5) and not stats.smooth
    # data arriving ahead of the play head never stalls
    stats = simulate_player([0.0, 0.5, 1.9], [1000, 1000, 500], bytes_per_s)
    assert stats.underrun_s == 0 and stats.smooth
    # a 50 ms stall is still smooth (no gap over 100 ms)
    assert simulate_player([0.0, 0.15], [100, 100], bytes_per_s).smooth
    # the longest stall: when it ended and after how much audio (0.2 s, then 0.3 s after 0.6 s)
    stats = simulate_player([0.0, 0.3, 0.4, 1.1], [100, 200, 300, 100], bytes_per_s)
    assert stats.max_stall_s == pytest.approx(0.3) and stats.max_stall_end_s == pytest.approx(1.1)
    assert stats.max_stall_after_s == pytest.approx(0.6)


def test_small_run_against_a_real_server_reports_sane_figures(server, clips, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--url", server.url, "--api-key", KEY, "--dataset", "synthetic-en1088",
               "--cache-dir", str(clips), "--num-prompts", "8", "--concurrency", "2",
               "--warmup", "--out", str(out), *FAST])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    doc = json.loads(out.read_text())
    assert not doc["failed"] and doc["dataset"]["prompts"] == 8
    assert "0.25" in doc["forced_length"] and "16" in doc["forced_length"]
    assert doc["forced_length"] in printed.out and "| 2 | 8 | 0 |" in printed.out
    assert "C=2 measure" in printed.err and "8/8" in printed.err  # the progress bar

    (run,) = doc["runs"]
    assert run["concurrency"] == 2 and run["num_requests"] == 8 and run["num_failed"] == 0
    assert run["warmup"]["num_requests"] == 8 and run["warmup"]["num_failed"] == 0  # discarded pass
    # the model's own stream (48 kHz stereo), not the server's default pcm layout (24 kHz mono)
    assert (doc["sample_rate"], doc["channels"]) == (48000, 2)
    bytes_per_s = doc["sample_rate"] * doc["channels"] * 2
    requests = run["requests"]
    for r in requests:
        assert r["ok"] and r["status"] == 200 and r["audio_bytes"] == sum(r["chunk_bytes"]) > 0
        assert r["audio_s"] == pytest.approx(r["audio_bytes"] / bytes_per_s)
        assert r["forced_frames"] == min(16, max(1, round(0.25 * r["target_chars"])))
        assert r["audio_s"] == pytest.approx(r["forced_frames"] * FRAME_S)
        # the report gives wall_s to 0.1 ms (rounded to nearest); the request's own times are exact
        assert 0 < r["ttfa_s"] <= r["latency_s"] and r["start_s"] + r["latency_s"] <= run["wall_s"] + 1e-4
        assert r["chunk_at_s"] == sorted(r["chunk_at_s"]) and r["underrun_s"] >= 0
    total = sum(r["audio_s"] for r in requests)
    assert run["audio_s_total"] == pytest.approx(total, abs=1e-3)
    assert run["audio_s_per_s"] == pytest.approx(total / run["wall_s"], rel=1e-3)
    assert run["requests_per_s"] == pytest.approx(8 / run["wall_s"], rel=1e-3)
    ttfa = sorted(1000 * r["ttfa_s"] for r in requests)
    assert run["ttfa_ms"]["mean"] == pytest.approx(sum(ttfa) / 8, abs=0.1)
    assert ttfa[0] <= run["ttfa_ms"]["p50"] <= run["ttfa_ms"]["p99"] <= ttfa[-1] + 0.1
    later = [1000 * r["ttfa_s"] for r in sorted(requests, key=lambda r: r["start_s"])[2:]]  # C=2
    assert run["ttfa_after_first_wave_ms"]["mean"] == pytest.approx(sum(later) / 6, abs=0.1)
    assert "after the first wave" in printed.out
    start, end = run["full_load"]["window_s"]  # every client busy until the 7th request ends
    assert start < end <= run["wall_s"] and run["full_load"]["audio_s_per_s"] > 0
    assert 0 < run["mean_in_flight"] <= 2 and "at full load" in printed.out
    assert run["rtf"]["mean"] == pytest.approx(
        sum(r["latency_s"] / r["audio_s"] for r in requests) / 8, rel=1e-3)
    assert 0 <= run["share_smooth"] <= 1 and run["chunk_gap_ms"]["max"] is not None


def test_the_first_wave_is_the_first_requests_sent():
    """Later requests' first audio leaves out the first `concurrency` requests sent, whatever the
    order the results came back in."""
    def result(i, start, ttfa):
        return RequestResult(index=i, utt_id=f"u{i}", target_chars=10, forced_frames=None, ok=True,
                             start_s=start, ttfa_s=ttfa, latency_s=1.0, audio_s=1.0)
    results = [result(0, 0.5, 0.1), result(1, 0.0, 0.4), result(2, 0.01, 0.3), result(3, 0.7, 0.2)]
    assert [r.index for r in after_first_wave(results, 2)] == [0, 3]
    assert summarize(2, results, 2.0, 1000.0)["ttfa_after_first_wave_ms"]["mean"] == pytest.approx(150.0)
    assert after_first_wave(results, 4) == []


def test_streams_stalling_together_are_reported_with_the_moment_and_the_audio_before():
    """Two first-wave streams stall at 0.5 s into the pass after their first 80 ms; a later one
    at 1.9 s after 1 s; a smooth one is left out; the printed table says so."""
    def result(i, start, at, size):
        return RequestResult(index=i, utt_id=f"u{i}", target_chars=10, forced_frames=None, ok=True,
                             start_s=start, ttfa_s=at[0], latency_s=at[-1], audio_s=sum(size) / 1000.0,
                             chunk_at_s=at, chunk_bytes=size)
    results = [result(0, 0.0, [0.2, 0.5], [80, 160]), result(1, 0.01, [0.21, 0.49], [80, 160]),
               result(2, 0.02, [0.1, 0.15], [80, 160]), result(3, 0.6, [0.1, 1.3], [1000, 100])]
    run = summarize(3, results, 2.0, 1000.0)
    assert run["share_smooth"] == 0.25
    assert run["stalls"] == {"streams": 3, "first_wave": 2, "at_s": [[0.5, 2], [1.9, 1]],
                             "after_audio_s": [[0.08, 2], [1.0, 1]]}
    assert "C=3 3, 2 of the first wave: at 0.5 s (2), 1.9 s (1); after 0.08 s (2), 1.00 s (1)" in format_table([run])


def test_full_load_leaves_out_the_first_audio_wait_and_the_tail():
    """Two clients, two requests each (1000 bytes a second of audio): the window runs from the
    first wave's last first audio to the first end that sent nothing after it."""
    def result(i, start, chunks, latency):
        return RequestResult(index=i, utt_id=f"u{i}", target_chars=10, forced_frames=None, ok=True,
                             start_s=start, ttfa_s=chunks[0][0], latency_s=latency, audio_s=1.0,
                             chunk_at_s=[at for at, _ in chunks], chunk_bytes=[n for _, n in chunks])
    results = [
        result(0, 0.0, [(0.1, 100), (0.5, 100)], 0.5),    # client A: first audio 0.1, ends 0.5
        result(1, 0.0, [(0.2, 100), (0.9, 100)], 0.9),    # client B: first audio 0.2, ends 0.9
        result(2, 0.5, [(0.1, 300), (1.0, 100)], 1.0),    # A again: 0.6 and 1.5 (A's last)
        result(3, 0.9, [(0.1, 400), (0.3, 100)], 0.3),    # B again: 1.0 and 1.2: the first last end
    ]
    load = full_load(results, 2, 4, 1000.0)
    # window (0.2, 1.2] s: bytes at 0.5, 0.6, 0.9, 1.0, 1.2 (100 + 300 + 100 + 400 + 100); not
    # the first wave's first audio (0.1, 0.2) nor the tail's (1.5)
    assert load == {"window_s": [0.2, 1.2], "audio_s_per_s": pytest.approx(1.0)}
    run = summarize(2, results, 1.5, 1000.0)
    assert run["full_load"] == load and run["mean_in_flight"] == pytest.approx(2.7 / 1.5, abs=0.01)
    assert "at full load" in format_table([run]) and "C=2 1.00 over 0.20-1.20 s" in format_table([run])
    assert full_load(results[:2], 2, 2, 1000.0) is None  # one request a client: no full-load window
    assert full_load(results, 2, 5, 1000.0) is None  # a request failed: not a whole pass
    assert full_load(results, 4, 4, 1000.0) is None


def test_bad_dataset_rows_fail_the_run(server, tmp_path, capsys):
    good = tone_wav(3.0, rate=24000)
    root = tmp_path / "seed"
    _write_seed_tts(root, [("good1", "A calm voice.", "g1.wav", "Hello from the benchmark.", good),
                           ("corrupt", "Not audio.", "bad.wav", "This clip is not a wav file.", b"RIFFjunk"),
                           ("missing", "Gone.", "gone.wav", "This clip does not exist.", None),
                           ("good2", "A calm voice.", "g2.wav", "Another sentence to speak.", good)])
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--url", server.url, "--api-key", KEY, "--dataset", str(root),
               "--concurrency", "2", "--no-warmup", "--no-progress", "--out", str(out), *FAST])
    printed = capsys.readouterr().out
    assert rc == 1 and "RESULT: FAILED" in printed
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert doc["failed"] and run["failed"] and run["num_failed"] == 2
    errors = {r["utt_id"]: r["error"] for r in run["requests"] if not r["ok"]}
    assert errors["corrupt"].startswith("HTTP 400") and "unreadable" in errors["missing"]
    assert {r["utt_id"] for r in run["requests"] if r["ok"]} == {"good1", "good2"}


def test_many_clients_against_a_stub_count_every_byte(clips, tmp_path, capsys):
    """64 concurrent streams (more than the tiny server runs quickly): exact byte accounting.
    Seed 0's first prompts are the ones the small run rendered, so few new clips are made."""
    out = tmp_path / "stub.json"
    with stub_speech_server() as url:
        rc = main(["bench", "serve", "--url", url, "--cache-dir", str(clips), "--num-prompts", "96",
                   "--concurrency", "64", "--no-warmup", "--no-progress", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out
    (run,) = json.loads(out.read_text())["runs"]
    assert run["num_requests"] == 96 and run["num_failed"] == 0
    for r in run["requests"]:
        assert r["audio_s"] == pytest.approx(r["forced_frames"] * FRAME_S)


def test_a_new_voice_is_another_recording_of_the_clip():
    import io

    import numpy as np
    import soundfile as sf

    from bench.voices import MAX_SKIP_S, new_voice

    rate = 24000
    clip = io.BytesIO()
    sf.write(clip, 0.5 * np.sin(np.linspace(0, 2000, 3 * rate)).astype(np.float32), rate, format="WAV",
             subtype="PCM_16")
    wav = clip.getvalue()
    versions = {new_voice(wav, salt, index) for salt in (1, 2) for index in range(4)}
    assert len(versions) == 8 and wav not in versions  # a new version per (pass, request)
    assert new_voice(wav, 7, 3) == new_voice(wav, 7, 3)  # the same in every client process
    for version in versions:
        audio, got_rate = sf.read(io.BytesIO(version), always_2d=True)
        assert got_rate == rate and audio.shape[1] == 1
        assert 3 - MAX_SKIP_S <= len(audio) / rate < 3 and np.abs(audio).max() <= 0.5 + 1e-4
    short = io.BytesIO()
    sf.write(short, np.zeros(int(1.05 * rate), np.float32), rate, format="WAV", subtype="PCM_16")
    assert sf.info(io.BytesIO(new_voice(short.getvalue(), 1, 1))).frames >= rate  # never under 1 s


@pytest.mark.parametrize(("voices", "hits"), [("new", 0), ("known", 8)])
def test_new_voices_miss_every_cache_even_after_a_warm_up(server, clips, tmp_path, capsys, voices, hits):
    """By default the warm-up and the measured pass each send voices the server never heard; with
    `--voices known` the warm-up pass makes the measured pass's clips known (all cache hits)."""
    out = tmp_path / "bench.json"
    args = ["--voices", voices] if voices != "new" else []  # new is the default
    rc = main(["bench", "serve", "--url", server.url, "--api-key", KEY, "--dataset", "synthetic-en1088",
               "--cache-dir", str(clips), "--num-prompts", "8", "--seed", "11", "--concurrency", "2",
               "--warmup", "--out", str(out), *args, *FAST])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["ref_cache_hits"], run["ref_cache_lookups"]) == (hits, 8)
    assert f"C=2 {hits} of 8" in printed.out


def test_server_stopped_mid_run_fails_the_run(server, clips):
    """Last in the file: it stops the module's server."""
    dataset = SyntheticEn1088(clips)
    prompts = select_prompts(dataset.prompts, 6, seed=0)
    dataset.prepare(prompts)
    config = ClientConfig(server.url, api_key=KEY, forced=ForcedLength(0.25, 16))
    info = asyncio.run(server_info(config))
    first = []

    def stop_after_first(result):
        if not first:
            first.append(result)
            threading.Thread(target=server.stop, daemon=True).start()

    results, wall_s = asyncio.run(run_pass(prompts, config, info, 2, stop_after_first))
    assert first[0].ok  # the key was accepted: the failures below come from the stop
    run = summarize(2, results, wall_s, info.bytes_per_s)
    assert run["failed"] and 1 <= run["num_failed"] < 6 and run["errors"]

