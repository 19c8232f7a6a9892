"""The golden fixtures ship with the repository, and a test whose fixtures are missing skips and
says which folder it looked for."""

from pathlib import Path

import pytest

from tests.conftest import GOLDEN_ROOT, golden_dir

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("moss_tts_local_v1_5", "moss_tts_delay", "moss_tts_realtime", "moss_audio_tokenizer_v1",
           "moss_audio_tokenizer_v2")


def test_every_fixture_folder_is_inside_the_repository() -> None:
    assert GOLDEN_ROOT.is_relative_to(REPO)
    for name in FOLDERS:
        folder = golden_dir(name)
        assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file(), name
        assert list(folder.glob("case*.npz")), f"{name}: no golden arrays"


def test_a_missing_folder_skips_and_names_it() -> None:
    with pytest.raises(pytest.skip.Exception) as skipped:
        golden_dir("no_such_model")
    assert str(GOLDEN_ROOT / "no_such_model") in str(skipped.value)
    assert "tests/golden/README.md" in str(skipped.value)
