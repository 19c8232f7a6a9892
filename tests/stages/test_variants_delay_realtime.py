"""The Delay-family and Realtime variants: registry choice, request adapters, and first audio
through the talker worker's loop.

Checkpoints are tiny random-weight ones written by `make_checkpoint` (one per variant). The
first-audio measurement drives the real `TalkerLoop` (the talker worker's loop) over real rings
with the variant's real talker runner and counts runner steps until the first code chunk leaves
for the codec, then decodes it with the variant's v1 codec runner. Streaming decode with the v1
codec equalling the whole decode is `tests/stages/test_codec_streaming.py` (case "v1").
"""

from __future__ import annotations

import json
import numpy as np
import pytest

from bench.timeline import summarize
from ipc.channel import Channel
from ipc.messages import CodecInbox, CoordinatorInbox, Submit, TalkerInbox
from ipc.shm import new_instance_id
from profiles import load_profile
from speech.job import OPTIONAL_FIELDS
from stages.models.delay.variant import split_transcripts
from stages.registry import load_variant
from stages.tools.make_checkpoint import make_checkpoint
from stages.variant import AdapterError, UnknownModel
from stages.workers.common import payload_array, schedule_from
from stages.workers.talker import TalkerLoop
from stages.workers.timeline import Timeline, read_events
from tests.conftest import speech_job

VARIANTS = ("delay", "ttsd", "sound-effect", "voice-generator", "realtime")
# the text each variant's adapter accepts for a plain request
ACCEPTED = {"delay": {}, "ttsd": {"text": "[S1] hello there [S2] hi"}, "sound-effect": {"text": "rain on a roof"},
            "voice-generator": {"instructions": "a calm, low voice"}, "realtime": {}}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    for name in VARIANTS:
        make_checkpoint(root / name, variant=name, size="tiny", seed=3)
    return root


@pytest.fixture(scope="module")
def profile():
    return load_profile("cpu", ["model.max_new_frames=200"])


def variant_of(checkpoints, name, profile):
    return load_variant(checkpoints / name, profile)


def codes(frames: int, n_vq: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, size=(frames, n_vq), dtype=np.int64)


# ---- the registry -------------------------------------------------------------------------------


def test_registry_picks_each_variant_from_its_config(checkpoints, profile) -> None:
    facts = {name: (v.name, v.n_vq, v.sample_rate, v.channels, v.frame_rate)
             for name in VARIANTS for v in [variant_of(checkpoints, name, profile)]}
    assert facts == {
        "delay": ("moss-tts-delay", 32, 24000, 1, 12.5),
        "ttsd": ("moss-ttsd", 16, 24000, 1, 12.5),
        "sound-effect": ("moss-sound-effect", 16, 24000, 1, 12.5),
        "voice-generator": ("moss-voice-generator", 16, 24000, 1, 12.5),
        "realtime": ("moss-tts-realtime", 16, 24000, 1, 12.5),
    }


def test_an_unnamed_16_codebook_delay_checkpoint_must_be_named(checkpoints, profile, tmp_path) -> None:
    config = json.loads((checkpoints / "ttsd" / "config.json").read_text())
    del config["mossvox_variant"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "audio_tokenizer").symlink_to(checkpoints / "ttsd" / "audio_tokenizer")
    with pytest.raises(ValueError, match="model.variant"):
        load_variant(tmp_path, profile)
    named = load_profile("cpu", ["model.variant=sound-effect"])
    assert load_variant(tmp_path, named).name == "moss-sound-effect"
    # the profile's name wins over the one make-checkpoint recorded
    assert load_variant(checkpoints / "ttsd", named).name == "moss-sound-effect"
    with pytest.raises(UnknownModel, match="Delay"):
        load_variant(checkpoints / "realtime", named)


def test_local_v1_checkpoint_is_refused_by_name(checkpoints, profile, tmp_path) -> None:
    config = json.loads((checkpoints / "delay" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "local_num_layers": 1}))
    with pytest.raises(UnknownModel, match="Local-Transformer v1"):
        load_variant(tmp_path, profile)


# ---- request adapters ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, job, message", [
    ("voice-generator", speech_job(), "instructions"),
    ("voice-generator", speech_job(instructions="  ", ref_codes=codes(20, 16)), "instructions"),
    ("ttsd", speech_job(text="[S1] a [S2] b", ref_codes=codes(20, 16), extra_ref_codes=[codes(20, 16, 1)],
                 ref_text="both clips' words, untagged"), "tag ref_text by speaker"),
    ("ttsd", speech_job(text="[S1] a [S2] b", ref_codes=codes(20, 16)), "go together"),
    ("ttsd", speech_job(text="[S1] a [S6] b"), r"from \[S1\] to \[S5\]"),
    ("delay", speech_job(ref_codes=codes(20, 32), extra_ref_codes=[codes(20, 32, 1)]), "at most one reference"),
    ("delay", speech_job(ref_codes=codes(20, 16)), "codes"),
    ("realtime", speech_job(ref_codes=codes(20, 16), extra_ref_codes=[codes(20, 16, 1)]), "one reference clip"),
])
def test_adapter_errors_say_what_to_change(checkpoints, profile, name, job, message) -> None:
    with pytest.raises(AdapterError, match=message):
        variant_of(checkpoints, name, profile).build_request(job)


# the optional fields each variant uses (docs/model_facts.md): TTSD has no instruction field,
# SoundEffect's prompt is its description alone, VoiceGenerator makes its own voice, and
# Realtime has neither continuation nor an instruction or language field
USES = {"delay": {"reference", "ref_text", "instructions", "language"},
        "ttsd": {"reference", "ref_text", "language"}, "sound-effect": set(),
        "voice-generator": {"instructions", "language"}, "realtime": {"reference"}}


def _same(a, b) -> bool:
    return np.array_equal(a.prompt, b.prompt) and (
        a.prime_codes is b.prime_codes is None or np.array_equal(a.prime_codes, b.prime_codes))


@pytest.mark.parametrize("name", VARIANTS)
def test_a_field_a_variant_does_not_use_is_ignored_and_one_it_uses_is_read(checkpoints, profile, name) -> None:
    variant = variant_of(checkpoints, name, profile)
    every = dict(ref_codes=codes(6, variant.n_vq), ref_text="the reference words",
                 instructions="a calm, low voice", language="English", sampling={"seed": 1})
    job = speech_job(**{**every, **ACCEPTED[name]})
    assert job.given_fields() == OPTIONAL_FIELDS
    ignored = variant.ignored_fields(job.given_fields())
    assert set(ignored) == set(OPTIONAL_FIELDS) - USES[name] == set(OPTIONAL_FIELDS) - variant.used_fields
    request = variant.build_request(job)  # accepted, whatever the variant does not use
    assert _same(request, variant.build_request(job.without(ignored)))  # ...which changes nothing
    for field in USES[name]:  # ...while each field it uses reaches the prompt (or is required)
        less = job.without({field} | ({"ref_text"} if field == "reference" else set()))
        try:
            assert not _same(request, variant.build_request(less)), f"{name} does not read {field}"
        except AdapterError:
            pass  # its absence is refused: it is read


def test_ttsd_gives_untagged_text_to_s1_with_the_first_reference_as_its_voice(checkpoints, profile) -> None:
    variant = variant_of(checkpoints, "ttsd", profile)
    assert variant.default_speaker("How are you?") == "[S1]"
    assert variant.default_speaker("[S2] How are you?") is None
    assert all(variant_of(checkpoints, other, profile).default_speaker("How are you?") is None
               for other in VARIANTS if other != "ttsd")
    plain = variant.build_request(speech_job(text="How are you?", sampling={"seed": 1}))
    assert _same(plain, variant.build_request(speech_job(text="[S1] How are you?", sampling={"seed": 1})))
    clip = dict(ref_codes=codes(6, 16), ref_text="the reference words", sampling={"seed": 1})
    cloned = variant.build_request(speech_job(text="How are you?", **clip))
    assert _same(cloned, variant.build_request(speech_job(text="[S1] How are you?", **clip)))
    assert (cloned.prime_codes == clip["ref_codes"]).all()  # S1 continues the first reference


@pytest.mark.parametrize("name", ["delay", "ttsd"])
def test_continuation_skips_the_codec_prime_when_the_profile_says_so(checkpoints, name) -> None:
    """`codec.prime_continuation: false` (the serving profiles): the same prompt, no prime chunk, so
    no request makes the codec decode its whole reference before anyone's next chunk."""
    primed = variant_of(checkpoints, name, load_profile("cpu"))
    clip = dict(ref_codes=codes(6, primed.n_vq), ref_text="[S1] the reference words", sampling={"seed": 1})
    job = speech_job(text="[S1] How are you?", **clip)
    primed = primed.build_request(job)
    plain = variant_of(checkpoints, name, load_profile("cpu", ["codec.prime_continuation=false"])).build_request(job)
    assert primed.prime_frames == 6 and plain.prime_codes is None and plain.prime_frames == 0
    assert np.array_equal(primed.prompt, plain.prompt)


def test_ttsd_clones_several_speakers_by_continuation(checkpoints, profile) -> None:
    variant = variant_of(checkpoints, "ttsd", profile)
    s1, s2 = codes(6, 16, 1), codes(4, 16, 2)
    job = speech_job(text="[S1] how are you [S2] fine", ref_codes=s1, extra_ref_codes=[s2],
              ref_text="[S1] first words [S2] second words")
    prompt = variant.build_request(job).prompt
    cfg = variant.processor.config
    # continuation: the prompt ends inside the assistant's audio block, on 10 gen-slot rows whose
    # codebook 0 is S1's frames then S2's (delayed layout: codebook 0 is not shifted)
    tail = prompt[-10:]
    assert (tail[:, 0] == cfg.gen_slot).all()
    assert (tail[:, 1] == np.concatenate([s1, s2])[:, 0]).all()
    # and each speaker's clip is in the user turn as its own reference block
    assert (prompt[:, 0] == cfg.user_slot).sum() == (6 + 15) + (4 + 15)


def test_split_transcripts() -> None:
    assert split_transcripts("[S1] a b [S2] c", 2) == ["[S1] a b", "[S2] c"]
    assert split_transcripts("just words", 1) == ["just words"]
    assert split_transcripts(None, 2) == [None, None]
    assert split_transcripts("[S2] only two", 2) == [None, "[S2] only two"]
    with pytest.raises(AdapterError, match="3 speakers but 2"):
        split_transcripts("[S1] a [S2] b [S3] c", 2)


def test_sound_effect_input_is_the_ambient_sound_field(checkpoints, profile) -> None:
    variant = variant_of(checkpoints, "sound-effect", profile)
    prompt = variant.build_request(speech_job(text="distant thunder")).prompt
    decoded = variant.processor.tokenizer.decode(prompt[:, 0].tolist())
    assert "- Ambient Sound:\ndistant thunder" in decoded
    assert "- Text:\nNone" in decoded


@pytest.mark.parametrize("name, expected", [
    ("delay", (1.7, 0.8, 25, 1.0)), ("ttsd", (1.1, 0.9, 50, 1.1)), ("sound-effect", (1.5, 0.6, 50, 1.2)),
    ("voice-generator", (1.5, 0.6, 50, 1.1)), ("realtime", (0.8, 0.6, 30, 1.1)),
])
def test_sampling_defaults_overrides_and_caps(checkpoints, profile, name, expected) -> None:
    variant = variant_of(checkpoints, name, profile)
    s = variant.build_request(speech_job(**ACCEPTED[name])).sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == expected
    assert s.max_new_frames == 200  # the model card's budget, capped by model.max_new_frames
    s = variant.build_request(speech_job(**ACCEPTED[name], sampling={"top_k": 3, "seed": 9, "max_new_frames": 10**6})).sampling
    assert (s.top_k, s.seed, s.max_new_frames) == (3, 9, 200)
    with pytest.raises(ValueError, match="unknown sampling fields"):
        variant.build_request(speech_job(**ACCEPTED[name], sampling={"beams": 2}))


# ---- first audio through the talker loop ---------------------------------------------------------


class LoopRig:
    """The talker worker's loop over real rings: the test plays coordinator and codec."""

    def __init__(self, runner, variant, profile, allocator=None, timeline=None, kernels=None) -> None:
        instance = new_instance_id()
        make = lambda name, t, role: Channel.create(name, msg_type=t, capacity=1 << 20, role=role,  # noqa: E731
                                                    instance=instance)
        self.inbox = make("inbox", TalkerInbox, "writer")
        self.codes = make("codes", CodecInbox, "reader")
        self.coord = make("coord", CoordinatorInbox, "reader")
        self.ends = [self.inbox.spec().open(), self.codes.spec().open(), self.coord.spec().open()]
        self.loop = TalkerLoop(runner, *self.ends, schedule_from(profile), variant.n_vq, timeline=timeline,
                               allocator=allocator, kernels=kernels)
        self.runner, self.n_vq = runner, variant.n_vq

    def close(self) -> None:
        for ch in [*self.ends, self.inbox, self.codes, self.coord]:
            ch.close()

    def chunks_until_done(self, request, initial_frames: int):
        """[(runner steps so far, still running?, CodeChunk, codes [T, n_vq])] of one request, sent
        as `EngineClient` sends it."""
        self.inbox.send(Submit(rid=1, client=0, sampling=request.sampling, initial_chunk_frames=initial_frames,
                               prime_frames=request.prime_frames), request.payload())
        out, steps = [], 0
        while True:
            self.loop.step()
            steps += 1
            while (rec := self.codes.try_recv()) is not None:
                with rec:
                    out.append((steps, self.runner.num_running() > 0, rec.msg, payload_array(rec, np.int64, self.n_vq)))
            if out and out[-1][2].final:
                return out
            assert steps < 500


@pytest.fixture(scope="module")
def first_audio_report():
    lines: list[str] = []
    yield lines
    print("\ntalker steps before the first audio chunk leaves for the codec:\n" + "\n".join(lines))


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("initial_frames", [1, 3])
def test_first_audio_leaves_after_n_vq_steps_for_delay_and_at_once_for_realtime(
        checkpoints, profile, name, initial_frames, first_audio_report) -> None:
    variant = variant_of(checkpoints, name, profile)
    rig = LoopRig(variant.make_talker_runner("cpu"), variant, profile)
    try:
        request = variant.build_request(speech_job(**ACCEPTED[name], forced_frames=20, sampling={"seed": 1}))
        prompt = request.prompt
        assert len(prompt) <= profile.talker.prefill_chunk_tokens  # the prefill is one step
        chunks = rig.chunks_until_done(request, initial_frames)
    finally:
        rig.close()
    steps, running, first, first_codes = chunks[0]
    expected = initial_frames if name == "realtime" else variant.n_vq + initial_frames
    assert steps == expected
    assert running and not first.final  # streaming: generation goes on after the first chunk
    assert first_codes.shape == (initial_frames, variant.n_vq)
    assert sum(len(c) for *_, c in chunks) == 20 and chunks[-1][2].finish_reason == "stop"
    codec = variant.make_codec_runner("cpu")
    codec.open(1)
    pcm = codec.decode([(1, first_codes)])[0]
    assert pcm.shape == (1, initial_frames * 1920) and np.isfinite(pcm).all()
    first_audio_report.append(f"  {name:16s} n_vq {variant.n_vq:2d}, initial chunk {initial_frames} frame(s): "
                              f"{steps} steps ({len(prompt)}-row prompt, 20 frames in {chunks[-1][0]} steps)")


def test_a_slow_step_is_logged_with_what_it_did(checkpoints, profile, monkeypatch, caplog) -> None:
    """A step over `SLOW_STEP_S` goes to the log with its batch and whether it recorded a graph or
    compiled a kernel (the stalls a server under load must not have), and what the CUDA allocator
    did since the last such line (counted here by a stand-in: the CPU has no CUDA allocator):
    every step counts here), and how many Triton kernels it specialised (a stand-in that counts
    one more at every read but the first two: the steps after the first each specialise one)."""
    monkeypatch.setattr("stages.workers.talker.SLOW_STEP_S", 0.0)
    variant = variant_of(checkpoints, "delay", profile)
    reads = iter(range(10**6))  # one device allocation between two reads, a retry every third
    allocator = lambda: (n := next(reads), n // 3)  # noqa: E731
    kernel_reads = iter(range(10**6))
    kernels = lambda: max(0, next(kernel_reads) - 1)  # noqa: E731  (reads 0, 0, 1, 2, ...)
    rig = LoopRig(variant.make_talker_runner("cpu"), variant, profile, allocator, kernels=kernels)
    try:
        request = variant.build_request(speech_job(**ACCEPTED["delay"], forced_frames=3))
        with caplog.at_level("WARNING", logger="stages.workers.talker"):
            chunks = rig.chunks_until_done(request, 1)
    finally:
        rig.close()
    slow = [r.getMessage() for r in caplog.records if "ms step" in r.getMessage()]
    assert len(slow) == chunks[-1][0]  # one line per step
    assert f"{len(request.prompt)} prompt tokens" in slow[0] and "1 running" in slow[0]
    # CPU: no graph, no kernel compiled; no collection timer given, so no time in collections
    assert "recorded 0 graph(s), compiled 0, specialised 0 Triton kernel(s) and collected garbage for 0 ms;" in slow[0]
    assert all("compiled 0, specialised 1 Triton kernel(s) and collected garbage for 0 ms;" in line for line in slow[1:])
    assert all("allocator made 1 device allocation(s)" in line for line in slow)
    assert [line.endswith("and 1 retry(ies)") for line in slow[:3]] == [False, False, True]


def test_the_timeline_holds_each_steps_device_allocations(checkpoints, profile, tmp_path) -> None:
    """With a timeline, every talker step records how many device allocations the CUDA allocator
    made inside it (a stand-in here: the runner's third step "allocates" twice), so a stalled
    step can be matched with a new allocation; the summary counts such steps."""
    variant = variant_of(checkpoints, "delay", profile)
    runner = variant.make_talker_runner("cpu")
    made, steps = [0], [0]
    real_step = runner.step

    def step():
        steps[0] += 1
        made[0] += 2 if steps[0] == 3 else 0
        return real_step()

    runner.step = step
    timeline = Timeline(tmp_path, "talker0")
    rig = LoopRig(runner, variant, profile, lambda: (made[0], 0), timeline)
    try:
        rig.chunks_until_done(variant.build_request(speech_job(**ACCEPTED["delay"], forced_frames=3)), 1)
    finally:
        rig.close()
        timeline.close()
    events = [e for e in read_events(tmp_path) if e["k"] == "talker_step"]
    assert len(events) == steps[0] and [e["allocs"] for e in events[:4]] == [0, 0, 2, 0]
    talker = summarize(events)["talker"]
    assert talker["allocating_steps"] == 1
    assert talker["allocating_step_max_ms"] == pytest.approx(events[2]["dur"] * 1e3)


def test_delay_continuation_emits_its_first_frame_one_step_sooner(checkpoints, profile) -> None:
    variant = variant_of(checkpoints, "delay", profile)
    rig = LoopRig(variant.make_talker_runner("cpu"), variant, profile)
    try:
        request = variant.build_request(speech_job(ref_codes=codes(8, 32), ref_text="the reference words",
                                            forced_frames=5))
        chunks = rig.chunks_until_done(request, 1)[1:]  # after the prime chunk
    finally:
        rig.close()
    assert chunks[0][0] == variant.n_vq  # no audio_start row to sample: one step less
    assert sum(len(c) for *_, c in chunks) == 5


def test_delay_continuation_context_travels_after_the_prompt_to_the_codec(checkpoints, profile) -> None:
    variant = variant_of(checkpoints, "delay", profile)
    reference = codes(8, 32, 5)
    job = speech_job(ref_codes=reference, ref_text="the reference words", forced_frames=5)
    request = variant.build_request(job)
    assert (request.prime_codes == reference).all() and request.prime_frames == 8
    assert len(request.payload()) == len(request.prompt) + 8  # the prompt holds them only delayed
    rig = LoopRig(variant.make_talker_runner("cpu"), variant, profile)
    try:
        chunks = rig.chunks_until_done(request, 1)
    finally:
        rig.close()
    prime = chunks[0]
    assert prime[2].prime and (prime[3] == reference).all()  # decoded first, audio dropped
    # the runner got the prompt alone: still a continuation, first frame after n_vq steps
    assert chunks[1][0] == variant.n_vq and sum(len(c) for *_, c in chunks[1:]) == 5


@pytest.mark.parametrize("name", ["delay", "realtime"])
def test_talker_runner_takes_the_profiles_attention_and_prefill_interval(checkpoints, name) -> None:
    """`talker.attention` and `talker.prefill_interval` reach the Delay and Realtime runners (they
    used to run the per-sequence reference attention whatever the profile said); graphs are CUDA
    only, so a CPU runner keeps the one-call step."""
    from stages.runtime.attention.backends import PaddedBatchAttention, ReferenceAttention

    chosen = load_profile("cpu", ["talker.attention=padded", "talker.prefill_interval=3"])
    runner = load_variant(checkpoints / name, chosen).make_talker_runner("cpu")
    assert isinstance(runner.attention, PaddedBatchAttention)
    assert runner.scheduler.prefill_interval == 3 and runner.backbone_graph_path == "off"
    default = load_variant(checkpoints / name, load_profile("cpu")).make_talker_runner("cpu")
    assert isinstance(default.attention, ReferenceAttention)  # "auto" on a CPU


def test_backbone_graphs_need_both_profile_switches_and_cuda() -> None:
    from stages.runtime.runner_options import talker_runner_options

    def graphs(device, *overrides):
        options = talker_runner_options(load_profile("default", list(overrides)), device, backbone_graphs=True)
        return options["cuda_graphs"]

    assert graphs("cuda")  # talker.backbone_graphs is on by default
    assert not graphs("cuda", "talker.backbone_graphs=false")
    assert not graphs("cuda", "talker.cuda_graphs=false")
    assert not graphs("cpu")


def test_realtime_text_arriving_while_it_speaks_gives_the_frames_of_the_whole_text(checkpoints, profile) -> None:
    """The talker loop over the real Realtime runner: the request is submitted with its first
    tokens and open input, pauses when they run out (its frames flushed to the codec, the loop
    idle), takes the rest in `Feed` records, and makes the frames of the whole text up front."""
    from ipc.messages import Feed

    variant = variant_of(checkpoints, "realtime", profile)
    text = "Realtime speaks while the text is still being written, one word after the other."
    job = dict(sampling={"seed": 5})
    rig = LoopRig(variant.make_talker_runner("cpu"), variant, profile)
    try:
        whole = np.concatenate([c for *_, c in rig.chunks_until_done(variant.build_request(speech_job(text, **job)), 1)])
        stream = variant.open_text_stream(speech_job("", **job))
        parts = [text[:34], text[34:60], text[60:]]
        stream.push(parts[0])
        request = stream.request()
        assert request is not None  # 12 tokens are there
        rig.inbox.send(Submit(rid=2, client=0, sampling=request.sampling, open_input=True), request.payload())
        got, pauses = [], 0
        for part in [*parts[1:], None]:
            for _ in range(200):  # until it pauses: the loop has nothing left to do
                rig.loop.step()
                while (rec := rig.codes.try_recv()) is not None:
                    with rec:
                        got.append(payload_array(rec, np.int64, rig.n_vq))
                if not rig.loop.has_work():
                    break
            assert not rig.loop.has_work() and rig.runner.num_running() == 1  # paused, not ended
            pauses += 1
            if part is None:
                stream.end()
            else:
                stream.push(part)
            final = part is None
            rig.inbox.send(Feed(rid=2, final=final, forced_frames=stream.forced_frames() if final else None),
                           stream.take_rows())
        while rig.runner.num_running() or rig.loop.has_work():
            rig.loop.step()
        while (rec := rig.codes.try_recv()) is not None:
            with rec:
                got.append(payload_array(rec, np.int64, rig.n_vq))
    finally:
        rig.close()
    assert pauses == 3
    np.testing.assert_array_equal(np.concatenate(got), whole)
