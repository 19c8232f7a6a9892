"""`lfq_nearest`, one quantizer stage's nearest code in one kernel (Triton's CPU interpreter
here), against the quantizer's torch ops: the same codes and straight-through rows for every
stage of an encode with rows of several lengths, in one block of the codebook or several; and
a reference encoded with `use_fused_encoder` takes it once a stage, with the plain path's codes,
also padded into encode graphs' buckets. On CUDA (GPU tests) a full-size quantizer against the
torch ops, and encode graphs recorded over the fused encoder."""

from tests import triton_cpu  # noqa: F401  (first: Triton's interpreter without a GPU)

import pytest  # noqa: E402
import torch  # noqa: E402

from stages.models.codec import lfq_nearest as kernel_module  # noqa: E402
from stages.models.codec.lfq_nearest import lfq_nearest  # noqa: E402
from tests.stages.test_codec_quantizer import quantizer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@torch.no_grad()
@pytest.mark.parametrize("seed", [0, 3])
def test_every_stage_matches_the_torch_ops(seed):
    q = quantizer(seed).to(DEVICE)
    gen = torch.Generator().manual_seed(seed + 1)
    z = torch.randn(5, 64, 37, generator=gen).to(DEVICE)
    lengths = torch.tensor([37, 30, 1, 37, 12], device=DEVICE)
    want = q.encode(z, lengths)
    got = q.encode(z, lengths, fused=True)
    assert torch.equal(got, want)


@torch.no_grad()
def test_one_stage_rows_and_codes_in_blocks_of_the_codebook(monkeypatch):
    """A codebook walked in blocks smaller than itself (as on a GPU) finds the same codes and the
    same straight-through rows as one block, and as the torch ops."""
    stage = quantizer(1).quantizers[0].to(DEVICE)
    gen = torch.Generator().manual_seed(9)
    z_e = torch.randn(3, 8, 50, generator=gen).to(DEVICE)
    book2, book_sq = stage.normalized_book()
    rows, codes = lfq_nearest(z_e, book2, book_sq, stage.codebook.weight)
    enc = torch.nn.functional.normalize(z_e.transpose(1, 2).reshape(-1, 8))
    want = (enc @ book2.t() - enc.pow(2).sum(1, keepdim=True) - book_sq).max(1)[1].view(3, 50)
    assert torch.equal(codes, want)
    chosen = stage.codebook(codes).transpose(1, 2)
    assert torch.equal(rows, z_e + (chosen - z_e))
    if DEVICE == "cpu":  # the GPU's blocks: 16 rows, 64 codes
        gpu_blocks = kernel_module.blocks("cuda", 1024)
        monkeypatch.setattr(kernel_module, "blocks", lambda device_type, codes: gpu_blocks)
        assert all(torch.equal(a, b) for a, b in zip(lfq_nearest(z_e, book2, book_sq, stage.codebook.weight),
                                                   (rows, codes)))


def test_it_refuses_what_it_cannot_read():
    stage = quantizer(1).quantizers[0]
    book2, book_sq = stage.normalized_book()
    with pytest.raises(ValueError, match="contiguous fp32"):
        lfq_nearest(torch.zeros(1, 50, 8).transpose(1, 2), book2, book_sq, stage.codebook.weight)
    with pytest.raises(ValueError, match="do not match"):
        lfq_nearest(torch.zeros(1, 4, 5), book2, book_sq, stage.codebook.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_on_cuda_a_full_size_quantizer_agrees_with_the_torch_ops():
    """The v2 quantizer's shape (32 stages, 1024 codes of 8) on CUDA, eight references of 6 s: the
    compiled kernel (16 rows, 64 codes a block) and cuBLAS round sums of 8 products in their own
    orders, so a near tie may go either way; a frame's later stages follow its first differing
    code. Nearly every code agrees, and every frame's first stage."""
    from stages.models.codec.config import QuantizerConfig
    from stages.models.codec.quantizer import ResidualLFQ

    torch.manual_seed(0)
    q = ResidualLFQ(QuantizerConfig(input_dim=768, rvq_dim=512, output_dim=768, num_quantizers=32,
                                    codebook_size=1024, codebook_dim=8)).cuda()
    for p in q.parameters():
        p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    z = torch.randn(8, 768, 75, device="cuda")
    lengths = torch.tensor([75, 70, 60, 75, 50, 75, 75, 40], device="cuda")
    want, got = q.encode(z, lengths), q.encode(z, lengths, fused=True)
    assert (got == want).float().mean().item() > 0.99
    assert (got[0] == want[0]).float().mean().item() > 0.999


@torch.no_grad()
def test_a_fused_encode_takes_the_kernel_once_a_stage(monkeypatch):
    """`use_fused_encoder`: every quantizer stage of the encode goes through `lfq_nearest`, and
    the codes are the plain path's."""
    from bench.codec import random_codec
    from stages.models.codec.config import CodecConfig, tiny_v2_config

    model = random_codec(CodecConfig.from_json(tiny_v2_config()), DEVICE, torch.float32, seed=5)
    wav = (0.3 * torch.randn(2, model.cfg.channels, 12 * model.cfg.downsample_rate,
                             generator=torch.Generator().manual_seed(4))).to(DEVICE)
    lengths = torch.tensor([7, 12], device=DEVICE) * model.cfg.downsample_rate
    want = model.encode(wav, lengths, 6).codes
    calls = []
    monkeypatch.setattr(kernel_module, "lfq_nearest", lambda *a: calls.append(1) or lfq_nearest(*a))
    model.use_fused_encoder()
    got = model.encode(wav, lengths, 6).codes
    assert len(calls) == 6
    for row, frames in enumerate((7, 12)):
        assert torch.equal(got[:, row, :frames], want[:, row, :frames])


def _fused_runners_and_clips(**graphs):
    """The tiny codec with `use_fused_encoder`: a plain runner, one with encode graphs (`graphs`:
    `encode_graphs_eager` or `encode_graphs`) of batches of 4 in one 16-frame length bucket (few
    buckets keep the interpreter's work small), and clips of 3, 11 and 7 frames and a bit."""
    import numpy as np

    from bench.codec import random_codec
    from stages.models.codec.config import CodecConfig, tiny_v2_config
    from stages.models.codec.runner import CodecRunner

    model = random_codec(CodecConfig.from_json(tiny_v2_config()), DEVICE, torch.float32, seed=6)
    model.use_fused_encoder()
    plain = CodecRunner(model, n_vq=6, max_slots=2)
    padded = CodecRunner(model, n_vq=6, max_slots=2, encode_batch=4, **graphs)
    hop = plain.samples_per_frame
    padded.encode_graphs.lengths = [16 * hop]
    rng = np.random.default_rng(8)
    clips = [(0.3 * rng.standard_normal((model.cfg.channels, n * hop + 5))).astype(np.float32) for n in (3, 11, 7)]
    return plain, padded, clips


@torch.no_grad()
def test_encode_graphs_over_the_fused_encoder_give_its_codes():
    """`codec.encode_graphs` with `codec.fused_encoder`: clips padded to a length bucket and a
    batch bucket give the codes of each clip's fused encode alone."""
    import numpy as np

    plain, padded, clips = _fused_runners_and_clips(encode_graphs_eager=True)
    got = padded.encode(clips)
    assert padded.encode_graphs.keys == [(4, 16 * plain.samples_per_frame)]
    for w, codes in zip(clips, got):
        np.testing.assert_array_equal(codes, plain.encode([w])[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_captured_encode_graphs_over_the_fused_encoder_replay_its_codes():
    """On CUDA the fused encoder's kernels record into encode graphs, and the replays give what
    the same padded buckets give uncaptured (the same shapes: the same kernels and roundings)."""
    import numpy as np

    _, eager, clips = _fused_runners_and_clips(encode_graphs_eager=True)
    _, graphed, _ = _fused_runners_and_clips(encode_graphs=True)
    assert graphed.capture_encode(budget_s=120) > 0
    for a, b in zip(eager.encode(clips), graphed.encode(clips)):
        np.testing.assert_array_equal(b, a)
    assert all(e.call.graph is not None for e in graphed.encode_graphs._entries.values())


@torch.no_grad()
def test_start_up_keeps_a_fused_encoder_that_agrees_and_turns_off_one_that_fails(monkeypatch, caplog):
    """`check_fused_encoder` (the codec's warm-up): a fused encoder whose codes agree with the plain
    path stays on; one whose kernel launch fails, or whose kernel finds wrong codes, is turned off
    with a warning naming `codec.fused_encoder`, and encodes go the plain way."""
    import logging

    from stages.workers.codec import check_fused_encoder

    _, runner, _ = _fused_runners_and_clips(encode_graphs_eager=True)
    model = runner.model
    assert check_fused_encoder(runner) and model.fused_encoder

    def broken(z_e, book2, book_sq, book):  # every frame the same code: wrong nearly everywhere
        rows, codes = lfq_nearest(z_e, book2, book_sq, book)
        return rows, torch.full_like(codes, 7)

    def failing(*args):
        raise RuntimeError("no kernel image for this device")

    for kernel, why in ((broken, "agree with the plain path's on"), (failing, "failed (RuntimeError")):
        model.use_fused_encoder()
        monkeypatch.setattr(kernel_module, "lfq_nearest", kernel)
        with caplog.at_level(logging.WARNING, logger="stages.workers.codec"):
            caplog.clear()
            assert not check_fused_encoder(runner)
        assert not model.fused_encoder
        assert why in caplog.text and "codec.fused_encoder" in caplog.text
    calls = []
    monkeypatch.setattr(kernel_module, "lfq_nearest", lambda *a: calls.append(1) or lfq_nearest(*a))
    runner.encode([torch.zeros(model.cfg.channels, 4 * model.cfg.downsample_rate).numpy()])
    assert calls == []  # the plain path from then on
