"""The Delay family and Realtime through the real server: one `mossvox serve` per variant on a
tiny random-weight checkpoint written by `make_checkpoint`, plus a Realtime server with
`api.strict_fields` on.

Each Delay or Realtime variant streams raw PCM (24 kHz mono) whose first chunk reaches the client
while the talker is still generating (its slot gauge, read from /metrics when the first bytes
arrive, is 1), and each variant's request-adapter errors come back as 400s in the OpenAI
envelope. One request carrying every optional field (`ref_audio`, `ref_text`, `instructions`,
`language`) succeeds against every family, which names the fields it ignored in
`X-Ignored-Fields` (and each batch item in `ignored_fields`) and whose audio is exactly that of
the request without them; where the family takes a reference, the reference changes the audio
(`tests/api/every_field.py`). TTSD takes a list of reference clips with a speaker-tagged transcript, and untagged text as [S1]'s; `mossvox synth` repeats --ref-audio for
it. `mossvox bench serve` completes against every Delay-family and Realtime server, each sent the
prompt set in its own fields (clips with transcripts, sound or voice descriptions).

The number of talker steps before the first chunk is measured in
`tests/stages/test_variants_delay_realtime.py`; streaming v1 decode = whole decode in
`tests/stages/test_codec_streaming.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from stages.tools.make_checkpoint import make_checkpoint
from tests.api.every_field import EVERY_FIELD, check_every_field, speech
from tests.api.helpers import assert_error, data_url, metric, parse_sse, tone_wav
from tests.api.server_process import REPO, ServerProcess

SAMPLES_PER_FRAME = 1920  # v1 codec: 24 kHz / 12.5 Hz
# a body each variant's adapter accepts, and enough forced frames that generation outlasts a
# /metrics round trip by a wide margin (Realtime's 16-step depth loop is slower per frame)
ACCEPTED = {
    "delay": ({"input": "Hello from the delay model."}, 150),
    "ttsd": ({"input": "[S1] Hello there. [S2] Hi, how are you?"}, 150),
    "sound-effect": ({"input": "rain on a tin roof"}, 150),
    "voice-generator": ({"input": "Hello there.", "instructions": "a calm, low voice"}, 150),
    "realtime": ({"input": "Hello from the realtime model."}, 250),  # long enough to outlast its first audio under load
}
# talker steps beyond one per frame: Delay opens audio (1 row) and drains n_vq - 1 delay rows;
# Realtime emits a frame from its prefill step on
EXTRA_STEPS = {"delay": 32, "ttsd": 16, "sound-effect": 16, "voice-generator": 16, "realtime": 0}
CLIP = data_url(tone_wav(1.5))
CLIP2 = data_url(tone_wav(1.5, hz=330.0))
# (body, message fragment) of one request each variant's adapter refuses: a field that is wrong,
# not one the variant does not use (SoundEffect uses none of the optional fields)
REFUSED = {
    "delay": ({"input": "Hi.", "ref_audio": [CLIP, CLIP2]}, "at most one reference"),
    "ttsd": ({"input": "[S1] Hi. [S6] Hello."}, "go from [S1] to [S5]"),
    "voice-generator": ({"input": "Hello there."}, "instructions"),
    "realtime": ({"input": "Hello.", "ref_audio": [CLIP, CLIP2]}, "one reference clip"),
}
BASE = {name: body for name, (body, _) in ACCEPTED.items()}
# what each family ignores of EVERY_FIELD (docs/model_facts.md): TTSD has no instruction field,
# SoundEffect's prompt is its description alone, VoiceGenerator makes its own voice, Realtime has
# neither continuation nor an instruction or language field (Local-v1.5, which uses them all, is
# checked on the demo model's server: tests/api/test_speech_e2e.py)
IGNORES = {"delay": (), "ttsd": ("instructions",),
           "sound-effect": ("ref_audio", "ref_text", "instructions", "language"),
           "voice-generator": ("ref_audio", "ref_text"), "realtime": ("ref_text", "instructions", "language")}
STRICT = "realtime-strict"
ROOTS = {"delay": "moss-tts-delay", "ttsd": "moss-ttsd", "sound-effect": "moss-sound-effect",
         "voice-generator": "moss-voice-generator", "realtime": "moss-tts-realtime"}
START_TIMEOUT_S = 360.0  # six servers start at once on a shared machine


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("variant-checkpoints")
    for name in ACCEPTED:
        make_checkpoint(root / name, variant=name, size="tiny", seed=4)
    return root


@pytest.fixture(scope="module")
def servers(checkpoints, tmp_path_factory):
    """One server per variant and the strict one, started together (start-up is mostly imports
    and waiting)."""
    started = {name: ServerProcess(tmp_path_factory.mktemp("data"), str(checkpoints / name),
                                   start_timeout_s=START_TIMEOUT_S)
               for name in ACCEPTED}
    started[STRICT] = ServerProcess(tmp_path_factory.mktemp("data"), str(checkpoints / "realtime"),
                                    sets=("api.strict_fields=true",), start_timeout_s=START_TIMEOUT_S)
    try:
        with ThreadPoolExecutor(len(started)) as pool:
            for future in [pool.submit(server.start) for server in started.values()]:
                future.result()
        yield started
    finally:
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(ServerProcess.stop, started.values()))


@pytest.fixture(params=list(ACCEPTED))
def served(request, servers):
    """(variant name, server, http client) of each variant's server."""
    server = servers[request.param]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield request.param, server, http


def talker_steps(http) -> float:
    """Talker steps so far (count of the engine's talker_batch_sizes), once the talker is idle."""
    deadline = time.monotonic() + 10
    text = http.get("/metrics").text
    while metric(text, "mossvox_engine_talker_slots") and time.monotonic() < deadline:
        time.sleep(0.05)
        text = http.get("/metrics").text
    counts = [line for line in text.splitlines() if line.startswith("mossvox_engine_talker_batch_sizes_count ")]
    return float(counts[0].split()[1]) if counts else 0.0


def test_each_variant_streams_its_first_audio_while_still_generating(served):
    name, server, http = served
    body, frames = ACCEPTED[name]
    # one short request first, so the codec's first-call costs (which a loaded machine stretches
    # past the whole generation) are not what the first chunk waits for
    warm = http.post("/v1/audio/speech", json={**body, "response_format": "pcm", "forced_frames": 4, "seed": 1})
    assert warm.status_code == 200, warm.text
    steps_before = talker_steps(http)
    arrivals, got, slots_at_first = [], 0, None
    with http.stream("POST", "/v1/audio/speech", json={
            **body, "response_format": "pcm", "stream_format": "audio", "forced_frames": frames,
            "initial_codec_chunk_frames": 1, "seed": 3}) as response:
        assert response.status_code == 200, response.read()
        assert (response.headers["x-audio-sample-rate"], response.headers["x-audio-channels"]) == ("24000", "1")
        for piece in response.iter_raw():
            arrivals.append(time.perf_counter())
            got += len(piece)
            if slots_at_first is None:
                slots_at_first = metric(http.get("/metrics").text, "mossvox_engine_talker_slots")
    assert slots_at_first == 1, "the first audio arrived only after the talker had finished"
    assert got == frames * SAMPLES_PER_FRAME * 2  # s16 mono, every forced frame
    assert len(arrivals) >= 3 and arrivals[-1] - arrivals[0] > 0.05  # later chunks kept coming
    # At most one frame per talker step, so with this many steps in all the first frame left by
    # step EXTRA_STEPS + 1 (Delay: n_vq + 1; Realtime: the prefill step)
    assert talker_steps(http) - steps_before == frames + EXTRA_STEPS[name]


@pytest.mark.parametrize("name", list(REFUSED))
def test_each_variant_refuses_what_its_adapter_cannot_serve_with_a_400(servers, name):
    body, message = REFUSED[name]
    response = httpx.post(f"{servers[name].url}/v1/audio/speech", json={**body, "response_format": "pcm"},
                          timeout=60)
    assert_error(response, 400, contains=message)


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_every_family_takes_every_field_and_names_those_it_ignores(servers, name):
    with httpx.Client(base_url=servers[name].url, timeout=60) as http:
        check_every_field(http, BASE[name], IGNORES[name])
        assert http.get("/v1/models").json()["data"][0]["root"] == ROOTS[name]


def test_strict_fields_turns_ignored_fields_into_a_400_naming_them(servers):
    with httpx.Client(base_url=servers[STRICT].url, timeout=60) as http:
        refused = http.post("/v1/audio/speech", json={**BASE["realtime"], **EVERY_FIELD, "response_format": "pcm"})
        error = assert_error(refused, 400, param="ref_text", contains="ref_text, instructions, language")
        assert "api.strict_fields" in error["message"] and error["code"] == "unused_field"
        # a field the model uses is no reason to refuse: the reference alone is served
        served = speech(http, {**BASE["realtime"], "ref_audio": CLIP})
        assert "x-ignored-fields" not in served.headers and served.headers["x-ref-cache"] == "miss"


def test_the_sse_done_event_names_the_ignored_fields_too(servers):
    body = {**BASE["realtime"], **EVERY_FIELD, "task_type": "Base", "stream_format": "sse",
            "response_format": "pcm", "forced_frames": 4}
    response = httpx.post(f"{servers['realtime'].url}/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 200, response.text
    fields = ["ref_text", "instructions", "language", "task_type"]
    assert response.headers["x-ignored-fields"] == ", ".join(fields)
    name, done = parse_sse(response.content)[-1]
    assert name == "speech.audio.done" and done["ignored_fields"] == fields


def test_each_batch_item_names_the_fields_its_model_ignored(servers):
    """A batch item reports what the model ignored of its own fields (a default beside `items`
    counts as the item's); under api.strict_fields only the item that carries such a field fails,
    with the 400 it would get alone."""
    body = {"items": [{"input": "Hello from the realtime model.", **EVERY_FIELD},
                      {"input": "Hello again.", "ref_audio": CLIP}, {"input": "And once more."}],
            "response_format": "pcm", "forced_frames": 4, "seed": 7}
    served = httpx.post(f"{servers['realtime'].url}/v1/audio/speech/batch", json=body, timeout=120)
    assert served.status_code == 200, served.text
    results = served.json()["results"]
    assert [r["status"] for r in results] == ["success"] * 3
    assert results[0]["ignored_fields"] == ["ref_text", "instructions", "language"]
    assert "ignored_fields" not in results[1] and "ignored_fields" not in results[2]
    with_default = httpx.post(f"{servers['realtime'].url}/v1/audio/speech/batch",
                              json={**body, "language": "English"}, timeout=120).json()["results"]
    assert [r.get("ignored_fields") for r in with_default] == [
        ["ref_text", "instructions", "language"], ["language"], ["language"]]
    strict = httpx.post(f"{servers[STRICT].url}/v1/audio/speech/batch", json=body, timeout=120)
    assert strict.status_code == 200, strict.text
    refused, *others = strict.json()["results"]
    assert refused["status"] == "error" and refused["status_code"] == 400
    assert refused["error"]["param"] == "ref_text" and refused["error"]["code"] == "unused_field"
    assert "ref_text, instructions, language" in refused["error"]["message"]
    assert [r["status"] for r in others] == ["success"] * 2
    ttsd = httpx.post(f"{servers['ttsd'].url}/v1/audio/speech/batch", timeout=120, json={
        "items": [{"input": "Hello there."}, {"input": "[S1] Hello there."}], "response_format": "pcm",
        "forced_frames": 4, "seed": 7}).json()["results"]
    assert ttsd[0]["untagged_speaker"] == "[S1]" and "untagged_speaker" not in ttsd[1]
    assert "ignored_fields" not in ttsd[0] and "ignored_fields" not in ttsd[1]


def test_a_voice_name_is_ignored_unlooked_up_by_a_family_without_references(servers):
    body = {**BASE["sound-effect"], "voice": "nobody-registered", "response_format": "pcm", "forced_frames": 2}
    ignored = httpx.post(f"{servers['sound-effect'].url}/v1/audio/speech", json=body, timeout=60)
    assert ignored.status_code == 200 and ignored.headers["x-ignored-fields"] == "voice"
    builtin = httpx.post(f"{servers['sound-effect'].url}/v1/audio/speech", json={**body, "voice": "alloy"},
                         timeout=60)
    assert builtin.status_code == 200 and "x-ignored-fields" not in builtin.headers  # the model's own voice
    unknown = httpx.post(f"{servers['realtime'].url}/v1/audio/speech", json=body, timeout=60)
    assert_error(unknown, 404, param="voice")  # a family with references looks the name up


def test_ttsd_speaks_untagged_text_as_s1_and_says_so(servers):
    clip = {"ref_audio": CLIP, "ref_text": "The reference words."}
    with httpx.Client(base_url=servers["ttsd"].url, timeout=60) as http:
        untagged = speech(http, {"input": "Hello there, how are you?", **clip})
        assert untagged.headers["x-untagged-speaker"] == "[S1]" and "x-ref-cache" in untagged.headers
        tagged = speech(http, {"input": "[S1] Hello there, how are you?", **clip})
        assert "x-untagged-speaker" not in tagged.headers
        assert tagged.content == untagged.content  # S1, with the first reference as its voice
        plain = speech(http, {"input": "Hello there, how are you?"})
        assert plain.headers["x-untagged-speaker"] == "[S1]" and plain.content != untagged.content


def test_ttsd_takes_one_clip_per_speaker_and_a_tagged_transcript(servers):
    body = {"input": "[S1] How are you? [S2] Fine, thanks.", "ref_audio": [CLIP, CLIP2],
            "ref_text": "[S1] The first clip. [S2] The second clip.", "response_format": "pcm",
            "forced_frames": 12}
    with httpx.Client(base_url=servers["ttsd"].url, timeout=60) as http:
        first = http.post("/v1/audio/speech", json=body)
        assert first.status_code == 200, first.text
        assert len(first.content) == 12 * SAMPLES_PER_FRAME * 2 and first.headers["x-ref-cache"] == "miss"
        assert http.post("/v1/audio/speech", json=body).headers["x-ref-cache"] == "hit"
        untagged = http.post("/v1/audio/speech", json={**body, "ref_text": "both clips, untagged"})
        assert_error(untagged, 400, contains="tag ref_text by speaker")
        too_many = http.post("/v1/audio/speech", json={**body, "ref_audio": [CLIP] * 6})
        assert_error(too_many, 400, param="ref_audio")


def test_synth_cli_repeats_ref_audio_for_ttsd(checkpoints, tmp_path):
    (tmp_path / "a.wav").write_bytes(tone_wav(1.5))
    (tmp_path / "b.wav").write_bytes(tone_wav(1.5, hz=330.0))
    cmd = [sys.executable, "-c", "import sys; from cli.main import main; sys.exit(main())", "synth",
           "[S1] Hi there. [S2] Hello.", "--model", str(checkpoints / "ttsd"), "-o", str(tmp_path / "out.wav"),
           "--ref-audio", str(tmp_path / "a.wav"), "--ref-audio", str(tmp_path / "b.wav"),
           "--ref-text", "[S1] first clip [S2] second clip", "--seed", "1"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    import soundfile

    audio, rate = soundfile.read(tmp_path / "out.wav")
    assert rate == 24000 and audio.ndim == 1 and len(audio) > 0
    refused = subprocess.run(cmd[:-4] + ["--direct"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "drop --direct" in refused.stderr


def test_delay_continuation_through_the_server_equals_direct_synthesis(servers, checkpoints):
    """The server primes the codec with the reference codes (they travel after the prompt: the
    prompt holds them only delayed), as the direct path does: the same samples come out."""
    import numpy as np

    from profiles import load_profile
    from stages.synth_direct import DirectSynthesizer

    wav = tone_wav(1.5)
    text, ref_text = "And then it continued.", "The reference words."
    with httpx.Client(base_url=servers["delay"].url, timeout=60) as http:
        served = http.post("/v1/audio/speech", json={
            "input": text, "ref_audio": data_url(wav), "ref_text": ref_text, "seed": 5,
            "forced_frames": 10, "response_format": "pcm"})
    assert served.status_code == 200, served.text
    got = np.frombuffer(served.content, dtype="<i2").astype(np.float32) / 32768
    direct = DirectSynthesizer(checkpoints / "delay", load_profile("cpu"))
    expected, _ = direct.synthesize(text, ref_audio=wav, ref_text=ref_text, seed=5, forced_frames=10)
    assert got.shape == (10 * SAMPLES_PER_FRAME,) and expected.shape == (1, got.size)
    assert np.abs(got - np.clip(expected[0], -1, 1)).max() < 2e-4


REALTIME_TEXT = ("Realtime starts speaking after the first words, while the rest of the text "
                 "is still being written by the model upstream.")


async def test_realtime_over_the_websocket_takes_text_while_it_speaks(servers):
    """MOSS-TTS-Realtime takes the session's text as it arrives, one request per utterance:
    audio starts after the first words (no sentence is complete, input.done not sent); text in
    1-5 character pieces speaks what one message does; a cancel mid-utterance frees everything."""
    import random

    from tests.api.stream_client import SpokenSentence, Utterance, connect, next_event, read_utterance, send, speak

    url = servers["realtime"].url
    config = {"response_format": "pcm", "seed": 4}
    rng = random.Random(2)
    pieces, at = [], 0
    while at < len(REALTIME_TEXT):
        pieces.append(REALTIME_TEXT[at:at + rng.randint(1, 5)])
        at += len(pieces[-1])
    async with connect(url) as ws:
        whole = await speak(ws, [REALTIME_TEXT], **config)
        await send(ws, "input.text", text="Words come one by one and the model ")
        start = await next_event(ws)
        assert start["type"] == "audio.start" and start["utterance_index"] == 1
        first = await next_event(ws)
        assert isinstance(first, bytes)  # heard after the first words, no sentence complete
        await send(ws, "input.cancel")
        await read_utterance(ws, until="speech.audio.cancelled", into=Utterance([SpokenSentence(start)]))
        for _ in range(100):
            gauges = {k: metric(httpx.get(url + "/metrics").text, f"mossvox_engine_{k}")
                      for k in ("running", "talker_slots", "codec_slots", "client_open")}
            if not any(gauges.values()):
                break
            time.sleep(0.1)
        assert not any(gauges.values()), gauges
        split = await speak(ws, pieces)
    assert [s.start["sentence_index"] for s in whole.sentences + split.sentences] == [0, 0]
    assert whole.sentences[0].start["sentence_text"] == REALTIME_TEXT
    frames = round(0.87 * len(REALTIME_TEXT))  # the cpu profile forces the length from the text
    assert len(whole.audio) == len(split.audio) == frames * SAMPLES_PER_FRAME * 2
    assert whole.audio == split.audio
    assert split.done == {"type": "session.done", "utterance_index": 2, "total_sentences": 1}


async def test_the_delay_family_over_the_websocket_speaks_sentence_by_sentence(servers):
    """A whole-text family with no continuation: each sentence is one request, spoken in order."""
    from tests.api.stream_client import connect, speak

    texts = ["The delay model speaks this first.", "Then this second sentence comes."]
    async with connect(servers["delay"].url) as ws:
        got = await speak(ws, [" ".join(texts)], response_format="pcm", seed=3)
    assert [s.start["sentence_text"] for s in got.sentences] == texts
    for s, text in zip(got.sentences, texts):
        assert (s.start["sample_rate"], s.start["channels"]) == (24000, 1)
        assert len(s.audio) == round(0.87 * len(text)) * SAMPLES_PER_FRAME * 2 == s.done["total_bytes"]


async def test_realtime_sessions_keep_at_most_two_utterances_in_the_engine(servers):
    """Utterances queued faster than they are spoken wait in the API process: at most the one
    being spoken and the next are engine requests; each is spoken in order, whole."""
    from tests.api.stream_client import speak_queued

    url = servers["realtime"].url
    texts = [f"Queued answer number {n} is spoken in its turn." for n in range(4)]
    got, seen = await speak_queued(url, texts, response_format="pcm", seed=4)
    assert [u.done["utterance_index"] for u in got] == list(range(4))
    assert [u.sentences[0].start["sentence_text"] for u in got] == texts
    for u, text in zip(got, texts):
        assert len(u.audio) == round(0.87 * len(text)) * SAMPLES_PER_FRAME * 2 == u.sentences[0].done["total_bytes"]
    assert 1 <= max(seen) <= 2, seen


async def test_a_websocket_session_names_the_fields_its_model_ignored(servers):
    """A `session.config` with every optional field is served as the HTTP request is: Realtime,
    fed the text while it speaks, ignores ref_text, instructions and language (each `audio.done`
    names them), uses the reference, and speaks exactly what the session without them speaks;
    TTSD ignores instructions and says which speaker untagged sentences went to; under
    api.strict_fields the config is refused, naming the fields, and the session goes on."""
    from tests.api.stream_client import connect, next_event, send, speak

    text = "One client speaks to every model family. It sends what it always sends."
    config = {"response_format": "pcm", "seed": 4}
    async with connect(servers["realtime"].url) as ws:
        full = await speak(ws, [text], **config, **EVERY_FIELD)
        bare = await speak(ws, [text], **config, ref_audio=EVERY_FIELD["ref_audio"])
        unvoiced = await speak(ws, [text], **config)
    assert [s.done["ignored_fields"] for s in full.sentences] == [["ref_text", "instructions", "language"]]
    assert all("ignored_fields" not in s.done for s in bare.sentences + unvoiced.sentences)
    assert full.audio == bare.audio != unvoiced.audio  # the reference is used, the rest ignored
    async with connect(servers["ttsd"].url) as ws:
        got = await speak(ws, ["[S1] Hello there. [S2] Hi, how are you? Fine, thanks."],
                          response_format="pcm", seed=3, instructions="a calm, low voice")
    assert [s.start["sentence_text"] for s in got.sentences] == [
        "[S1] Hello there.", "[S2] Hi, how are you?", "Fine, thanks."]
    assert [s.done.get("untagged_speaker") for s in got.sentences] == [None, None, "[S1]"]
    assert all(s.done["ignored_fields"] == ["instructions"] for s in got.sentences)
    async with connect(servers[STRICT].url) as ws:
        await send(ws, "session.config", **config, **EVERY_FIELD, event_id="cfg")
        refused = await next_event(ws)
        assert refused["type"] == "error" and refused["event_id"] == "cfg"
        assert refused["error"]["code"] == "unused_field" and refused["error"]["param"] == "ref_text"
        assert "ref_text, instructions, language" in refused["message"]
        served = await speak(ws, [text], **config, ref_audio=EVERY_FIELD["ref_audio"])
    assert served.audio == bare.audio and "ignored_fields" not in served.sentences[0].done


# what the bench's prompt set for each model (`--dataset auto`) carries that the model ignores:
# Realtime has no use for the clips' transcripts; the others get prompts in their own fields
BENCH_IGNORED = {"realtime": {"ref_text": 4}, "delay": {}, "ttsd": {}, "sound-effect": {}, "voice-generator": {}}


@pytest.mark.parametrize("name", list(BENCH_IGNORED))
def test_bench_serve_completes_against_every_model(servers, name, tmp_path, capsys):
    from cli.main import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--url", servers[name].url, "--cache-dir", str(tmp_path / "clips"),
               "--num-prompts", "4", "--concurrency", "2", "--no-warmup", "--no-progress",
               "--frames-per-char", "0.25", "--max-new-tokens", "8", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["num_requests"] == 4 and run["num_failed"] == 0
    assert run["ignored_fields"] == BENCH_IGNORED[name]
    with_clips = doc["dataset"]["distinct_clips"] > 0
    assert with_clips == (name not in ("sound-effect", "voice-generator"))
    assert all((r["ref_cache"] is not None) == with_clips for r in run["requests"])  # the clips were used
    if name == "realtime":
        assert "the server ignored ref_text (4 of 4 requests)" in printed
