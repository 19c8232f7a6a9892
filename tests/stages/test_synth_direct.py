"""Direct synthesis on the tiny demo model (random weights): `mossvox synth` writes a 48 kHz stereo
file of the forced duration (a 16-bit WAV as the server writes, or the format its name or --format
says), with and without a reference clip, under any profile; streaming chunks add up."""

import logging

import numpy as np
import pytest
import soundfile as sf

from cli.main import main as cli_main
from profiles import load_profile
from stages.synth_direct import DirectSynthesizer, synthesize
from stages.tools.demo_model import ensure_demo_model, resolve_checkpoint

SAMPLES_PER_FRAME = 3840  # v2 codec, per channel, 80 ms at 48 kHz


def forced_frames(text: str) -> int:
    return max(1, round(0.87 * len(text)))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    cache = tmp_path_factory.mktemp("demo-cache")
    ensure_demo_model(cache)
    return cache


@pytest.fixture(scope="module")
def synth(cache_dir):
    profile = load_profile("cpu", [f"model.demo_cache_dir={cache_dir}"])
    return DirectSynthesizer(ensure_demo_model(cache_dir), profile)


@pytest.fixture
def reference_wav(tmp_path):
    """A 0.6 s mono 22.05 kHz clip (two tones and a little noise)."""
    rate = 22050
    t = np.arange(int(0.6 * rate)) / rate
    wav = 0.2 * np.sin(2 * np.pi * 180 * t) + 0.1 * np.sin(2 * np.pi * 1250 * t)
    wav += 0.01 * np.random.default_rng(3).standard_normal(t.size)
    path = tmp_path / "ref.wav"
    sf.write(path, wav.astype(np.float32), rate, subtype="PCM_16")
    return path


def run_cli(cache_dir, out, text, *extra):
    return cli_main(["synth", text, "-o", str(out), "--seed", "7",
                     "--set", f"model.demo_cache_dir={cache_dir}", *extra])


def check_wav(path, text):
    assert sf.info(path).subtype == "PCM_16"  # the server's WAV: 16-bit samples
    data, rate = sf.read(path, always_2d=True)
    assert rate == 48000 and data.shape[1] == 2
    assert data.shape[0] == forced_frames(text) * SAMPLES_PER_FRAME
    assert np.isfinite(data).all() and np.abs(data).max() > 0
    return data


def test_cli_synth_plain_text(cache_dir, tmp_path, caplog):
    text = "Hello there, tiny model."
    with caplog.at_level(logging.INFO):
        assert run_cli(cache_dir, tmp_path / "plain.wav", text, "--language", "English",
                       "--instructions", "calm") == 0
    check_wav(tmp_path / "plain.wav", text)
    assert "RANDOM weights" in caplog.text
    assert "force_length_from_text is on" in caplog.text


@pytest.mark.parametrize("path", ["--direct", "--engine"])
def test_the_demo_model_speaks_its_whole_text_under_the_default_profile(cache_dir, tmp_path, path, capfd):
    """`default` leaves the length to the model, but the demo model's random stop head fires at
    random (often at once): the demo's length is forced from its text under any profile. The
    workers (`--engine`) end without a library's exit noise on the shared stderr."""
    text = "The demo model speaks every word of this."
    assert not load_profile("default").model.force_length_from_text
    assert run_cli(cache_dir, tmp_path / "default.wav", text, "--profile", "default", path) == 0
    check_wav(tmp_path / "default.wav", text)
    err = capfd.readouterr().err
    assert "nanobind" not in err and "leaked" not in err, err[-2000:]


def test_a_named_checkpoint_keeps_the_profile_as_it_is(cache_dir):
    profile = load_profile("default", [f"model.demo_cache_dir={cache_dir}"])
    demo, served = resolve_checkpoint(profile, None)
    assert demo == ensure_demo_model(cache_dir) and served.model.force_length_from_text
    assert resolve_checkpoint(profile, demo) == (demo, profile)  # a real checkpoint stops by itself


def test_cli_synth_with_reference_clip(cache_dir, tmp_path, reference_wav):
    text = "Clone this voice."
    assert run_cli(cache_dir, tmp_path / "clone.wav", text, "--ref-audio", str(reference_wav)) == 0
    check_wav(tmp_path / "clone.wav", text)
    assert run_cli(cache_dir, tmp_path / "cont.wav", text, "--ref-audio", str(reference_wav),
                   "--ref-text", "Some reference words.") == 0
    check_wav(tmp_path / "cont.wav", text)


def test_cli_rejects_ref_text_without_audio_and_undecodable_references(cache_dir, tmp_path, capsys):
    assert run_cli(cache_dir, tmp_path / "x.wav", "Hi.", "--ref-text", "orphan transcript") == 2
    bogus = tmp_path / "not-audio.wav"
    bogus.write_bytes(b"this is not a wav file")
    assert run_cli(cache_dir, tmp_path / "x.wav", "Hi.", "--ref-audio", str(bogus)) == 2
    assert "cannot decode" in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists()


def test_cli_synth_writes_the_format_its_output_names(cache_dir, tmp_path):
    """-o x.mp3 is an mp3 (not a WAV under an mp3 name); --format wins over the extension."""
    import av

    text = "Hello there, tiny model."
    assert run_cli(cache_dir, tmp_path / "speech.mp3", text, "--direct") == 0
    assert run_cli(cache_dir, tmp_path / "speech.audio", text, "--direct", "--format", "flac") == 0
    with av.open(str(tmp_path / "speech.mp3")) as container:
        stream = container.streams.audio[0]
        assert container.format.name == "mp3" and stream.codec_context.sample_rate == 48000
        samples = sum(frame.samples for frame in container.decode(stream))
    assert abs(samples - forced_frames(text) * SAMPLES_PER_FRAME) < 0.1 * 48000
    audio, rate = sf.read(tmp_path / "speech.audio", always_2d=True)
    assert (rate, audio.shape) == (48000, (forced_frames(text) * SAMPLES_PER_FRAME, 2))


def test_cli_synth_refuses_empty_text_and_an_unknown_extension(cache_dir, tmp_path, capsys):
    assert run_cli(cache_dir, tmp_path / "empty.wav", "  ") == 2
    assert "empty" in capsys.readouterr().err and not (tmp_path / "empty.wav").exists()
    assert run_cli(cache_dir, tmp_path / "speech.xyz", "Hi.") == 2
    assert "--format" in capsys.readouterr().err and not (tmp_path / "speech.xyz").exists()


def test_seeded_output_is_reproducible_and_streams_in_schedule_chunks(synth):
    text = "Seeded words."
    chunks = []
    pcm, stats = synth.synthesize(text, seed=11, on_chunk=chunks.append)
    assert stats.frames == forced_frames(text) and pcm.shape == (2, stats.frames * SAMPLES_PER_FRAME)
    sizes = [c.shape[1] // SAMPLES_PER_FRAME for c in chunks]
    assert sizes[0] == 1 and all(s == 15 for s in sizes[1:-1]) and sum(sizes) == stats.frames
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), pcm)
    again, _ = synth.synthesize(text, seed=11)
    np.testing.assert_array_equal(again, pcm)
    other, _ = synth.synthesize(text, seed=12)
    assert not np.array_equal(other, pcm)


def test_reference_becomes_a_voice_clone_or_continuation_prompt(synth, reference_wav):
    text = "Short."
    _, plain = synth.synthesize(text, seed=1)
    _, clone = synth.synthesize(text, seed=1, ref_audio=reference_wav)
    _, cont = synth.synthesize(text, seed=1, ref_audio=reference_wav, ref_text="Ref words.")
    ref_frames = int(0.6 * 48000) // SAMPLES_PER_FRAME  # the clip resampled to 48 kHz, whole frames
    none_ids = len(synth.variant.processor.tokenizer.encode("None"))  # the reference field's text
    assert clone.prompt_rows == plain.prompt_rows - none_ids + 1 + ref_frames + 1  # audio_start, rows, audio_end
    assert cont.prompt_rows > plain.prompt_rows + ref_frames  # transcript text + assistant rows
    assert clone.frames == cont.frames == forced_frames(text)


def test_one_shot_function_equals_the_synthesizer(synth, cache_dir):
    pcm = synthesize(ensure_demo_model(cache_dir), "One shot.", seed=5)
    expected, _ = synth.synthesize("One shot.", seed=5)
    np.testing.assert_array_equal(pcm, expected)


def test_instructions_reach_the_prompt(synth):
    _, plain = synth.synthesize("Same text.", seed=1)
    _, instructed = synth.synthesize("Same text.", seed=1, instructions="a slow and very calm voice")
    assert instructed.prompt_rows > plain.prompt_rows  # "None" replaced by the instruction
