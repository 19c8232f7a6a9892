"""Reference-encode graphs (`stages.models.codec.encode_graphs`): waveforms padded to a length bucket and
batches to a batch bucket give the codes of the plain encode; on CUDA, captured replays equal the
padded eager path."""

import numpy as np
import pytest
import torch

from bench.codec import random_codec
from stages.models.codec.config import CodecConfig, tiny_v2_config
from stages.models.codec.runner import CodecRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")
N_VQ = 12


def tiny_model(device: str = "cpu"):
    return random_codec(CodecConfig.from_json(tiny_v2_config()), device, torch.float32, seed=3)


def clips(rate: int, seconds, seed: int = 0) -> list[np.ndarray]:
    """Stereo noise-like clips [2, samples] of the given lengths (not whole frames)."""
    rng = np.random.default_rng(seed)
    return [(0.3 * rng.standard_normal((2, int(s * rate) + 7))).astype(np.float32) for s in seconds]


def test_padded_buckets_give_the_plain_encodes_codes():
    model = tiny_model()
    plain = CodecRunner(model, n_vq=N_VQ, max_slots=2)
    graphed = CodecRunner(model, n_vq=N_VQ, max_slots=2, encode_graphs_eager=True, encode_batch=4)
    rate, hop = plain.sample_rate, plain.samples_per_frame
    batch = clips(rate, (0.5, 1.3, 2.9))
    want = [plain.encode([w])[0] for w in batch]  # one by one: no batch padding at all
    got = graphed.encode(batch)
    for w, a, b in zip(batch, want, got):
        assert b.shape == (w.shape[1] // hop, N_VQ)
        np.testing.assert_array_equal(b, a)
    four_s = round(4.0 * rate / hop) * hop
    assert graphed.encode_graphs.keys == [(4, four_s)]  # 3 clips -> a batch of 4, padded to 4 s


def test_what_does_not_fit_encodes_eagerly_and_the_same():
    model = tiny_model()
    plain = CodecRunner(model, n_vq=N_VQ, max_slots=2)
    graphed = CodecRunner(model, n_vq=N_VQ, max_slots=2, encode_graphs_eager=True, encode_batch=2)
    rate = plain.sample_rate
    too_many = clips(rate, (0.4, 0.6, 0.8), seed=1)  # 3 > encode_batch 2
    too_long = clips(rate, (33.0,), seed=2)  # past the longest bucket (32 s)
    for batch in (too_many, too_long):
        for a, b in zip(plain.encode(batch), graphed.encode(batch)):
            np.testing.assert_array_equal(b, a)
    assert graphed.encode_graphs.keys == []


def test_capture_ahead_makes_every_bucket_once():
    runner = CodecRunner(tiny_model(), n_vq=N_VQ, max_slots=2, encode_graphs_eager=True, encode_batch=3)
    made = runner.capture_encode()
    buckets = {b for b, _ in runner.encode_graphs.keys}
    assert buckets == {1, 2, 3} and made == len(runner.encode_graphs.keys) == 3 * len(runner.encode_graphs.lengths)
    assert runner.capture_encode() == 0
    assert CodecRunner(tiny_model(), n_vq=N_VQ, max_slots=2).capture_encode() == 0  # no encode graphs


def test_encode_graphs_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        CodecRunner(tiny_model(), n_vq=N_VQ, max_slots=2, encode_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_encode_equals_padded_eager_on_cuda():
    model = tiny_model("cuda")
    eager = CodecRunner(model, n_vq=N_VQ, max_slots=2, encode_graphs_eager=True, encode_batch=4)
    graphed = CodecRunner(model, n_vq=N_VQ, max_slots=2, encode_graphs=True, encode_batch=4)
    batch = clips(eager.sample_rate, (0.7, 3.1, 5.0), seed=5)
    assert graphed.capture_encode(budget_s=120) > 0
    for a, b in zip(eager.encode(batch), graphed.encode(batch)):
        np.testing.assert_array_equal(b, a)
    assert all(e.call.graph is not None for e in graphed.encode_graphs._entries.values())


def test_a_bound_in_samples_keeps_only_the_buckets_within_it():
    """`encode_batch_samples`: only buckets (B, S) with B x S within the bound are made ahead; a
    batch whose bucket lies beyond it encodes eagerly, with the same codes."""
    model = tiny_model()
    plain = CodecRunner(model, n_vq=N_VQ, max_slots=2)
    rate, hop = plain.sample_rate, plain.samples_per_frame
    four_s, eight_s = (round(s * rate / hop) * hop for s in (4.0, 8.0))
    graphed = CodecRunner(model, n_vq=N_VQ, max_slots=2, encode_graphs_eager=True, encode_batch=4,
                          encode_batch_samples=2 * four_s)
    graphs = graphed.encode_graphs
    graphs.lengths = [four_s, eight_s]  # two length buckets keep the tiny codec's captures few
    assert graphed.capture_encode() == 3
    assert sorted(graphs.keys) == [(1, four_s), (1, eight_s), (2, four_s)]
    wide = clips(rate, (1.0, 1.1, 0.9))  # three 1 s clips: a batch of 4 at 4 s, beyond the bound
    assert not graphs.fits(len(wide), max(w.shape[1] for w in wide))
    got = graphed.encode(wide)
    for w, codes in zip(wide, got):
        np.testing.assert_array_equal(codes, plain.encode([w])[0])
    assert len(graphs.keys) == 3  # nothing recorded for it
