"""Streaming decode attending over the slots' rings in place (`ring_attention`, Triton) equals the
copy-and-mask path. With a CUDA device the compiled kernel runs on it; without one Triton's
interpreter runs it on CPU tensors (TRITON_INTERPRET=1 must be set before triton is imported,
which this module does first thing, as the talker's Triton tests do)."""

import torch

import tests.triton_cpu  # noqa: E402, F401  (before triton: its CPU interpreter)

import pytest  # noqa: E402

pytest.importorskip("triton")

from bench.codec import random_codec  # noqa: E402
from stages.models.codec.config import CodecConfig, tiny_v2_config  # noqa: E402
from stages.models.codec.streaming import StreamingDecoder  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def decode(model, codes: torch.Tensor, sizes: list[int], valid_pad: int = 0) -> torch.Tensor:
    """codes [nq, 2, T] in chunks of `sizes`, rows in slots 3 and 0; with `valid_pad`, every chunk
    is padded by that many frames of code 0 and decoded with its real length as valid frames."""
    decoder = StreamingDecoder(model, num_slots=4, max_chunk_frames=15)
    parts, begin = [], 0
    slots = torch.tensor([3, 0], device=DEVICE)
    for n in sizes:
        piece = codes[:, :, begin: begin + n]
        if valid_pad and n + valid_pad <= 15:
            pad = torch.zeros(piece.shape[0], 2, valid_pad, dtype=piece.dtype, device=DEVICE)
            audio = decoder.decode(torch.cat([piece, pad], -1), slots, torch.tensor([n, n], device=DEVICE))
            audio = audio[..., : n * model.cfg.downsample_rate]
        else:
            audio = decoder.decode(piece, slots)
        parts.append(audio)
        begin += n
    return torch.cat(parts, dim=-1)


def test_in_place_ring_attention_equals_copy_and_mask():
    """Chunks 1, 15 and 4 frames (past the 16-frame windows of the tiny codec), the short ones
    padded by 3 frames with their real lengths as valid frames (a padded dispatch's rows)."""
    cfg = CodecConfig.from_json(tiny_v2_config())
    model = random_codec(cfg, DEVICE, torch.float32, seed=9)
    codes = torch.randint(0, 1024, (12, 2, 20), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    sizes = [1, 15, 4]
    want = decode(model, codes, sizes)
    model.use_ring_attention()
    got = decode(model, codes, sizes, valid_pad=3)
    model.use_ring_attention(0)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_ring_attention_up_to_a_chunk_length(monkeypatch):
    """With a frame limit, chunks up to it attend in place and longer ones copy the rings out, in
    one stream (the rings are shared by both paths); the audio equals copy-and-mask throughout."""
    import stages.models.codec.ring_attention as ring

    cfg = CodecConfig.from_json(tiny_v2_config())
    model = random_codec(cfg, DEVICE, torch.float32, seed=9)
    codes = torch.randint(0, 1024, (12, 2, 24), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    sizes = [1, 2, 15, 4, 2]
    want = decode(model, codes, sizes)
    lengths = []  # query tokens of each in-place call
    kernel = ring.ring_attention
    monkeypatch.setattr(ring, "ring_attention", lambda q, *a: lengths.append(q.shape[1]) or kernel(q, *a))
    model.use_ring_attention(2)
    got = decode(model, codes, sizes)
    model.use_ring_attention(0)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    tokens = {stage.tokens_per_frame for stage in model.decoder_stages()}
    assert lengths and set(lengths) <= {n * t for n in (1, 2) for t in tokens}  # the 15- and 4-frame chunks copied
