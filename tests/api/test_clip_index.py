"""The validated clips shared by API processes: a clip decoded by one loader is known to another
loader over the same directory without decoding, within that loader's own limits; a damaged
entry is ignored, never trusted."""

from __future__ import annotations

import base64

import numpy as np
import pytest

import api.reference as reference
from api.clip_index import ClipIndex, KnownClip
from api.errors import ApiError
from api.reference import ReferenceLoader
from tests.api.test_reference import policy, wav_bytes


@pytest.fixture
def decoded(monkeypatch) -> list[int]:
    """One item per clip decoded (its audio, not its base64)."""
    calls: list[int] = []
    decode = reference.decode_audio_bytes
    monkeypatch.setattr(reference, "decode_audio_bytes", lambda *a, **k: calls.append(1) or decode(*a, **k))
    return calls


async def test_a_clip_validated_by_one_process_is_known_to_another_without_decoding(tmp_path, decoded):
    first, other = (ReferenceLoader(policy(), index=ClipIndex(tmp_path / "ref_clips")) for _ in range(2))
    clip = "data:audio/wav;base64," + base64.b64encode(wav_bytes(1.5)).decode()
    seen = await first.load(clip)
    assert len(decoded) == 1
    known = await other.load(clip)
    assert len(decoded) == 1  # known from the shared entry
    assert (known.digest, known.duration_s, known.rate) == (seen.digest, seen.duration_s, seen.rate)
    np.testing.assert_array_equal(known.wav, seen.wav)  # its waveform, when the codes miss, is the same
    assert len(decoded) == 2


async def test_a_file_clip_is_shared_by_its_bytes_and_read_again_each_time(tmp_path, decoded):
    (tmp_path / "ref.wav").write_bytes(wav_bytes(1.5))
    first, other = (ReferenceLoader(policy(tmp_path), index=ClipIndex(tmp_path / "ref_clips")) for _ in range(2))
    seen = await first.load(str(tmp_path / "ref.wav"))
    assert (await other.load(str(tmp_path / "ref.wav"))).digest == seen.digest and len(decoded) == 1
    (tmp_path / "ref.wav").write_bytes(wav_bytes(2.5))  # new bytes under the same name: decoded
    changed = await other.load(str(tmp_path / "ref.wav"))
    assert len(decoded) == 2 and changed.duration_s == pytest.approx(2.5)


async def test_an_entry_beyond_this_servers_limits_is_not_trusted(tmp_path, decoded):
    """Servers with other limits may share a data directory: a clip another one accepted is
    judged again here, and refused with this server's own error."""
    clip = base64.b64encode(wav_bytes(3.0)).decode()
    await ReferenceLoader(policy(), index=ClipIndex(tmp_path)).load(clip)
    for strict in (policy(max_seconds=2.0), policy(max_bytes=50_000)):
        with pytest.raises(ApiError) as err:
            await ReferenceLoader(strict, index=ClipIndex(tmp_path)).load(clip)
        assert err.value.status in (400, 413)
    assert len(decoded) == 2  # the long one decoded to be refused; the large one refused by size


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"digest": "x"}', b'{"digest": 1, "duration_s": 1, "rate": 1, "size": 1}'])
async def test_a_damaged_entry_is_ignored_and_written_again(tmp_path, decoded, damage):
    index = ClipIndex(tmp_path)
    clip = base64.b64encode(wav_bytes(1.5)).decode()
    seen = await ReferenceLoader(policy(), index=index).load(clip)
    (entry,) = [p for p in tmp_path.rglob("*") if p.is_file()]
    entry.write_bytes(damage)
    again = await ReferenceLoader(policy(), index=index).load(clip)
    assert len(decoded) == 2 and again.digest == seen.digest  # decoded again, the same clip
    assert index.get(bytes.fromhex(entry.name)) == KnownClip(seen.digest, seen.duration_s, seen.rate,
                                                            len(wav_bytes(1.5)))


def test_an_unwritable_directory_leaves_the_clip_unshared_not_refused(tmp_path):
    index = ClipIndex(tmp_path)
    (tmp_path / "ab").write_text("a file where a folder should be")
    index.put(bytes.fromhex("ab" + "00" * 31), KnownClip("d", 1.0, 16000, 10))  # logged, not raised
    assert index.get(bytes.fromhex("ab" + "00" * 31)) is None
    assert [p.name for p in tmp_path.iterdir()] == ["ab"]  # no temporary file left behind
