"""Voice registry on disk: round trip, replacement only when asked, deletion, names, sharing across
instances."""

from __future__ import annotations

import numpy as np
import pytest

from api.voices import VoiceExists, VoiceRegistry, valid_voice_name


def codes(frames: int = 5, n_vq: int = 4, base: int = 0) -> np.ndarray:
    return (np.arange(frames * n_vq).reshape(frames, n_vq) + base).astype(np.int64)


def test_put_get_list_delete_round_trip(tmp_path):
    reg = VoiceRegistry(tmp_path)
    reg.put(name="alice", codes=codes(), namespace="ns", consent="yes", duration_s=2.5, ref_text="hi")
    voice = reg.get("alice")
    np.testing.assert_array_equal(voice.codes, codes())
    assert voice.info.ref_text == "hi" and voice.info.frames == 5 and voice.namespace == "ns"
    assert [v.name for v in reg.list()] == ["alice"]
    assert reg.delete("alice") and reg.get("alice") is None and not reg.delete("alice")
    assert reg.list() == []


def test_second_instance_sees_uploads_replacements_and_deletions(tmp_path):
    a, b = VoiceRegistry(tmp_path), VoiceRegistry(tmp_path)
    a.put(name="v1", codes=codes(), namespace="ns", consent="c", duration_s=1.0, ref_text=None)
    assert b.get("v1").info.frames == 5
    a.put(name="v1", codes=codes(frames=9, base=7), namespace="ns", consent="c", duration_s=1.0, ref_text=None,
          overwrite=True)
    np.testing.assert_array_equal(b.get("v1").codes, codes(frames=9, base=7))
    b.delete("v1")
    assert a.get("v1") is None
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_taken_name_is_refused_whichever_instance_wrote_it(tmp_path):
    a, b = VoiceRegistry(tmp_path), VoiceRegistry(tmp_path)
    a.put(name="v1", codes=codes(), namespace="ns", consent="first", duration_s=1.0, ref_text=None)
    with pytest.raises(VoiceExists):
        b.put(name="v1", codes=codes(frames=9), namespace="ns", consent="second", duration_s=1.0, ref_text=None)
    assert a.get("v1").info.consent == "first" and a.get("v1").info.frames == 5
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("name,ok", [("alice", True), ("A-b_c.1", True), ("../x", False), ("a/b", False),
                                     ("", False), (".hidden", False), ("x" * 65, False), ("a.", False)])
def test_voice_names_are_safe_file_names(name, ok):
    assert valid_voice_name(name) is ok
