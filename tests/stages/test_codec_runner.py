"""CodecRunner: per-request slots are isolated, reused after close, batched by chunk length; encode
through the runner gives the golden codes (floor length rule, first n_vq quantizers)."""

import numpy as np
import pytest
import torch

from stages.models.codec.runner import CodecRunner, SlotsExhausted
from stages.models.codec.streaming import StreamingDecoder
from tests.conftest import golden_codec, golden_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def v2():
    return golden_codec(golden_dir("moss_audio_tokenizer_v2"))


@pytest.fixture(scope="module")
def v1():
    return golden_codec(golden_dir("moss_audio_tokenizer_v1"))


def whole(model, codes: np.ndarray) -> np.ndarray:
    """The whole-sequence decode of codes [T, n_vq] -> [channels, samples]."""
    return model.decode(torch.from_numpy(codes.T[:, None, :].copy()))[0].numpy()


def test_attributes(v2, v1):
    r2 = CodecRunner(v2[0], n_vq=12, max_slots=2)
    assert (r2.sample_rate, r2.channels, r2.samples_per_frame, r2.n_vq) == (48000, 2, 3840, 12)
    r1 = CodecRunner(v1[0], n_vq=16, max_slots=2)
    assert (r1.sample_rate, r1.channels, r1.samples_per_frame, r1.n_vq) == (24000, 1, 1920, 16)


@pytest.mark.parametrize("graphs_eager", [False, True])  # True: padded buckets + scratch slot, no recording
def test_interleaved_requests_are_isolated(v2, graphs_eager):
    model, g = v2
    a = g["decode_codes"][:12, 0].T.copy()  # [32, 12]
    b = np.ascontiguousarray(a[::-1])
    runner = CodecRunner(model, n_vq=12, max_slots=4, graphs_eager=graphs_eager)
    runner.open(7)
    runner.open(9)
    sched_a, sched_b = [1, 15, 15, 1], [1, 2, 4, 8, 16, 1]
    got = {7: [], 9: []}
    pa = pb = 0
    for i in range(max(len(sched_a), len(sched_b))):
        items = []
        if i < len(sched_a):
            items.append((7, a[pa: pa + sched_a[i]]))
            pa += sched_a[i]
        if i < len(sched_b):
            items.append((9, b[pb: pb + sched_b[i]]))
            pb += sched_b[i]
        for (rid, codes), pcm in zip(items, runner.decode(items)):
            assert pcm.dtype == np.float32 and pcm.shape == (2, codes.shape[0] * 3840)
            got[rid].append(pcm.copy())  # a view valid until the next decode
    assert np.abs(np.concatenate(got[7], axis=1) - whole(model, a)).max() < 1e-4
    assert np.abs(np.concatenate(got[9], axis=1) - whole(model, b)).max() < 1e-4


def test_equal_lengths_decode_in_one_batched_call(v1, monkeypatch):
    model, g = v1
    codes = g["decode_codes"][:16, 0].T.copy()  # [40, 16]
    runner = CodecRunner(model, n_vq=16, max_slots=3)
    calls = []
    real = StreamingDecoder.decode
    monkeypatch.setattr(StreamingDecoder, "decode", lambda self, c, s: calls.append(len(s)) or real(self, c, s))
    for rid in (1, 2, 3):
        runner.open(rid)
    out = runner.decode([(1, codes[:5]), (2, codes[10:13]), (3, codes[20:25])])
    assert sorted(calls) == [1, 2]  # T=5 twice in one call, T=3 alone
    assert np.abs(out[0] - whole(model, codes[:5])).max() < 1e-4
    assert np.abs(out[1] - whole(model, codes[10:13])).max() < 1e-4
    assert np.abs(out[2] - whole(model, codes[20:25])).max() < 1e-4


def test_slots_are_bounded_and_reused_after_close(v1):
    model, g = v1
    codes = g["decode_codes"][:16, 0].T.copy()
    runner = CodecRunner(model, n_vq=16, max_slots=2)
    runner.open(1)
    runner.open(2)
    with pytest.raises(SlotsExhausted):
        runner.open(3)
    runner.decode([(1, codes[:20])])  # leaves history in request 1's slot
    runner.close(1)
    runner.close(1)  # closing twice is harmless
    runner.open(3)  # takes the freed slot, starting fresh
    out = np.concatenate([runner.decode([(3, codes[b: b + 15])])[0] for b in range(0, 40, 15)], axis=1)
    assert np.abs(out - whole(model, codes)).max() < 1e-4
    assert runner.num_open() == 2


def test_decode_rejects_bad_items(v1):
    model, g = v1
    runner = CodecRunner(model, n_vq=16, max_slots=2)
    codes = g["decode_codes"][:16, 0].T.copy()
    with pytest.raises(KeyError):
        runner.decode([(5, codes[:2])])
    runner.open(5)
    with pytest.raises(ValueError, match="expected"):
        runner.decode([(5, codes[:2, :12])])
    with pytest.raises(ValueError, match="outside"):
        runner.decode([(5, np.full((2, 16), 1024))])
    with pytest.raises(ValueError, match="several chunks"):
        runner.decode([(5, codes[:2]), (5, codes[2:4])])


@pytest.mark.parametrize("version,n_vq", [("v2", 12), ("v1", 16)])
def test_encode_gives_golden_codes(v2, v1, version, n_vq):
    model, g = v2 if version == "v2" else v1
    runner = CodecRunner(model, n_vq=n_vq, max_slots=1)
    wav = g["encode_input_waveform"]  # [channels, samples], not a multiple of the hop
    short = np.ascontiguousarray(wav[:, : 7 * runner.samples_per_frame + 100])
    full_codes, short_codes = runner.encode([wav, short])
    want = g[f"encode_nq{n_vq}_audio_codes"][:, 0, : int(g["encode_audio_codes_lengths"][0])].T
    assert full_codes.dtype == np.int64 and np.array_equal(full_codes, want)
    assert short_codes.shape == (7, n_vq) and np.array_equal(short_codes, want[:7])  # causal: a prefix


def test_empty_terminal_chunk_gives_empty_pcm(v2):
    model, _ = v2
    runner = CodecRunner(model, n_vq=12, max_slots=1)
    runner.open(1)
    (pcm,) = runner.decode([(1, np.zeros((0, 12), dtype=np.int64))])
    assert pcm.shape == (2, 0) and pcm.dtype == np.float32


def dispatched(model, decode_alone: bool, graphs_eager: bool, partners: int) -> list[np.ndarray]:
    """Stream 0's PCM over three chunks, each dispatched with `partners` other streams' chunks of
    the same length (their codes differ)."""
    runner = CodecRunner(model, n_vq=12, max_slots=8, graphs_eager=graphs_eager, decode_alone=decode_alone)
    codes = np.random.default_rng(3).integers(0, runner.codebook_size, (48, 12))  # [T, n_vq]
    for rid in range(1 + partners):
        runner.open(rid)
    out, at = [], 0
    for n in (1, 4, 15):
        items = [(rid, np.ascontiguousarray(np.roll(codes, 5 * rid, axis=0)[at: at + n]))
                 for rid in range(1 + partners)]
        out.append(np.array(runner.decode(items)[0], copy=True))
        at += n
    return out


@pytest.mark.parametrize("graphs_eager", [False, True])
def test_decode_alone_gives_a_chunk_the_same_bits_whatever_its_dispatch_holds(v2, graphs_eager):
    model, _ = v2
    alone = dispatched(model, True, graphs_eager, partners=0)
    for partners in (1, 6):
        for a, b in zip(alone, dispatched(model, True, graphs_eager, partners)):
            np.testing.assert_array_equal(a, b)
    batched = dispatched(model, False, graphs_eager, partners=6)  # the same audio up to rounding
    assert max(np.abs(a - b).max() for a, b in zip(alone, batched)) < 1e-4


def test_decode_alone_refuses_cut_or_side_by_side_chunks(v1):
    for kw in (dict(split_chunks=True), dict(decode_lanes=2)):
        with pytest.raises(ValueError, match="decode_alone"):
            CodecRunner(v1[0], n_vq=16, max_slots=2, graphs_eager=True, decode_alone=True, **kw)
