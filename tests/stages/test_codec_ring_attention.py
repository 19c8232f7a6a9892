"""Streaming decode attending over the slots' rings in place (`ring_attention`, Triton) equals the
copy-and-mask path. With a CUDA device the compiled kernel runs on it; without one Triton's
interpreter runs it on CPU tensors (TRITON_INTERPRET=1 must be set before triton is imported,
which this module does first thing, as the talker's Triton tests do)."""

import torch

from tests import triton_cpu  # noqa: E402, F401  (before triton: its CPU interpreter)

import pytest  # noqa: E402

pytest.importorskip("triton")

from bench.codec import random_codec  # noqa: E402
from stages.models.codec.config import CodecConfig, tiny_v2_config  # noqa: E402
from stages.models.codec.streaming import StreamingDecoder  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# audio against audio, relative to the peak: on CUDA a padded call's matmuls (more rows) take other
# fp32 kernels than the unpadded reference's, ~3e-4 of the peak apart after the tiny codec's layers
# (an H200); a wrong ring, mask or norm is off by the signal itself
AUDIO_TOL = 1e-4 if DEVICE == "cpu" else 1e-3
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
    assert (got - want).abs().max().item() <= AUDIO_TOL * want.abs().max().item()


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
    assert (got - want).abs().max().item() <= AUDIO_TOL * want.abs().max().item()
    tokens = {stage.tokens_per_frame for stage in model.decoder_stages()}
    assert lengths and set(lengths) <= {n * t for n in (1, 2) for t in tokens}  # the 15- and 4-frame chunks copied


def test_rope_and_ring_writes_in_one_kernel_equal_the_torch_ops():
    """`rope_ring_write`: q rotated, k rotated and v written at their ring rows, as
    `apply_interleaved_rope` then `index_copy_` do (fp32 math; fp32 and bf16 tensors)."""
    from stages.models.codec.ring_write import rope_ring_write, rope_table
    from stages.models.codec.transformer import apply_interleaved_rope, rope_rotor

    g = torch.Generator().manual_seed(5)
    B, T, H, S, C = 3, 4, 2, 5, 24
    # D 24: a head row shorter than the kernel's 32-wide tile (masked)
    for dtype, D in ((torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 24)):
        qkv = torch.randn(B, T, 3, H, D, generator=g).to(DEVICE, dtype)
        start = torch.tensor([0, 7, 30], device=DEVICE)
        pos = start[:, None] + torch.arange(T, device=DEVICE)
        rotor = rope_rotor(pos, D, 10000.0)
        slots = torch.tensor([4, 0, 2], device=DEVICE)
        rows = (slots[:, None] * C + pos % C).reshape(-1)
        k_ring, v_ring = (torch.randn(S, C, H, D, generator=g).to(DEVICE, dtype) for _ in range(2))
        want_k, want_v = k_ring.clone(), v_ring.clone()
        qk = apply_interleaved_rope(qkv[:, :, :2], rotor)
        want_k.view(S * C, -1).index_copy_(0, rows, qk[:, :, 1].reshape(B * T, -1))
        want_v.view(S * C, -1).index_copy_(0, rows, qkv[:, :, 2].reshape(B * T, -1))
        q = rope_ring_write(qkv, rope_table(rotor), k_ring, v_ring, rows)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert q.shape == (B, T, H, D) and q.is_contiguous()
        torch.testing.assert_close(q, qk[:, :, 0], atol=tol, rtol=tol)
        torch.testing.assert_close(k_ring, want_k, atol=tol, rtol=tol)  # other rows untouched
        torch.testing.assert_close(v_ring, want_v, atol=0, rtol=0)  # values copied as they are


@pytest.mark.parametrize("T, block_m", [(1, 64), (5, 64), (40, 16)])
def test_rope_writes_and_attention_in_one_kernel_equal_the_two_kernels(T, block_m):
    """`rope_write_attend`: the same output and rings as `rope_ring_write` then `ring_attention`,
    one query tile or several (40 positions in tiles of 16: later tiles attend over keys an
    earlier tile of the same program wrote), rows whose chunks wrap around the ring, a chunk cut
    into three rows of its slot (given out of order and apart: each piece attends over the keys
    of the ones before it), fp32 and bf16, a head row narrower than the kernel's tile."""
    from stages.models.codec.ring_attention import ring_attention
    from stages.models.codec.ring_write import rope_ring_write, rope_table
    from stages.models.codec.ring_write_attention import rope_write_attend
    from stages.models.codec.transformer import rope_rotor

    g = torch.Generator().manual_seed(6)
    H, S, context = 2, 5, 24
    C = context + 3 * T + 7
    cut = 2 * C + 3  # slot 1's chunk: pieces at cut, cut + T, cut + 2T
    start = torch.tensor([0, cut + 2 * T, C - 2, cut, 3 * C + 5, cut + T], device=DEVICE)  # rows 2, 4 wrap
    slots = torch.tensor([4, 1, 0, 1, 2, 1], device=DEVICE)
    B = len(slots)
    for dtype, D in ((torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 24)):
        qkv = torch.randn(B, T, 3, H, D, generator=g).to(DEVICE, dtype)
        pos = start[:, None] + torch.arange(T, device=DEVICE)
        table = rope_table(rope_rotor(pos, D, 10000.0))
        rows = (slots[:, None] * C + pos % C).reshape(-1)
        k_ring, v_ring = (torch.randn(S, C, H, D, generator=g).to(DEVICE, dtype) for _ in range(2))
        want_k, want_v = k_ring.clone(), v_ring.clone()
        q = rope_ring_write(qkv, table, want_k, want_v, rows)
        want = ring_attention(q, want_k, want_v, slots, start, context, block_m=block_m)
        got = rope_write_attend(qkv, table, k_ring, v_ring, slots, start, context, block_m=block_m)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert got.shape == want.shape == (B, T, H, D)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        torch.testing.assert_close(k_ring, want_k, atol=0, rtol=0)
        torch.testing.assert_close(v_ring, want_v, atol=0, rtol=0)
        assert not torch.equal(got[0], got[1])  # rows differ: a real check


def test_fused_ring_writes_decode_the_same_audio(monkeypatch):
    """Streaming decode with RoPE and the ring writes fused equals the in-place path without them
    and the copy-and-mask path, padded chunks included."""
    import stages.models.codec.ring_write as ring_write

    calls = []
    fused = ring_write.rope_ring_write
    monkeypatch.setattr(ring_write, "rope_ring_write", lambda *a: calls.append(1) or fused(*a))
    cfg = CodecConfig.from_json(tiny_v2_config())
    model = random_codec(cfg, DEVICE, torch.float32, seed=9)
    codes = torch.randint(0, 1024, (12, 2, 20), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    sizes = [1, 15, 4]
    want = decode(model, codes, sizes)
    model.use_ring_attention(fused_writes=True)
    got = decode(model, codes, sizes, valid_pad=3)
    layers = sum(stage.num_layers for stage in model.decoder_stages())
    assert len(calls) == len(sizes) * layers  # every layer of every chunk took the fused path
    model.use_ring_attention()
    plain = decode(model, codes, sizes, valid_pad=3)
    assert len(calls) == len(sizes) * layers
    model.use_ring_attention(0)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= AUDIO_TOL * want.abs().max().item()
    assert (got - plain).abs().max().item() <= AUDIO_TOL * want.abs().max().item()


def test_residual_add_and_layer_norm_in_one_kernel_equal_the_torch_ops():
    """`residual_norm`: the sum `addcmul` makes and the LayerNorm of that sum as stored, for fp32
    and bf16 rows, widths a power of two or not (masked), rows not a multiple of a tile."""
    from torch import nn

    from stages.models.codec.residual_norm import residual_norm

    g = torch.Generator().manual_seed(6)
    for dtype, D, rows in ((torch.float32, 32, 7), (torch.bfloat16, 32, 130), (torch.float32, 48, 5)):
        x, y = (torch.randn(rows, D, generator=g).to(DEVICE, dtype) for _ in range(2))
        gain = (0.1 * torch.randn(D, generator=g)).to(DEVICE, dtype)
        norm = nn.LayerNorm(D, eps=1e-5).to(DEVICE, dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
            norm.bias.copy_(0.1 * torch.randn(D, generator=g))
            want_sum = torch.addcmul(x, gain, y)
            want_norm = norm(want_sum)
            got_sum, got_norm = residual_norm(x, y, gain, norm)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got_sum, want_sum, atol=tol, rtol=tol)
        torch.testing.assert_close(got_norm, want_norm, atol=tol, rtol=tol)


@pytest.mark.parametrize("part", ["norms", "attention"])
def test_fused_norms_and_one_kernel_attention_decode_the_same_audio(monkeypatch, part):
    """Streaming decode with the residual adds and LayerNorms fused (on top of the fused ring
    writes), and with the attention in the ring writes' kernel too (as it would be served),
    equals the copy-and-mask path, padded chunks included, every layer of every chunk on the
    fused path; the model refuses either without fused writes."""
    import stages.models.codec.residual_norm as residual_norm
    import stages.models.codec.ring_write_attention as one_kernel

    module, name = (residual_norm, "residual_norm") if part == "norms" else (one_kernel, "rope_write_attend")
    calls = []
    fused = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or fused(*a))
    cfg = CodecConfig.from_json(tiny_v2_config())
    model = random_codec(cfg, DEVICE, torch.float32, seed=9)
    with pytest.raises(ValueError, match="fused_writes"):
        model.use_ring_attention(**{f"fused_{part}": True})
    codes = torch.randint(0, 1024, (12, 2, 20), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    sizes = [1, 15, 4]
    want = decode(model, codes, sizes)
    model.use_ring_attention(fused_writes=True, fused_norms=True, fused_attention=part == "attention")
    got = decode(model, codes, sizes, valid_pad=3)
    model.use_ring_attention(0)
    layers = sum(stage.num_layers for stage in model.decoder_stages())
    per_chunk = 2 * layers - len(model.decoder_stages()) if part == "norms" else layers  # norms: 2 a layer, 1 in a stage's last
    assert len(calls) == len(sizes) * per_chunk
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= AUDIO_TOL * want.abs().max().item()


@pytest.mark.parametrize("in_place", [False, True, "one_kernel"])
def test_a_chunk_cut_into_rows_of_its_slot_decodes_as_one(in_place):
    """One call of 4-frame rows: slot 3's 15-frame chunk as four rows (offsets 0, 4, 8, 12, the
    last with 3 valid frames) beside slot 0's 2-frame chunk padded to 4; then a 1-frame chunk
    each. Every piece's queries see the earlier pieces' keys, written in the same call, and the
    counters end after the real frames: both streams' audio equals decoding them whole, with the
    rings copied out, read in place, or written and read in one kernel a layer."""
    cfg = CodecConfig.from_json(tiny_v2_config())
    model = random_codec(cfg, DEVICE, torch.float32, seed=9)
    codes = torch.randint(0, 1024, (12, 2, 16), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    a, b = codes[:, 0], codes[:, 1]  # [nq, 16] each: slot 3 takes 15 + 1 frames, slot 0 2 + 1
    want_a = model.decode(a[:, None, :16])[0]
    want_b = model.decode(b[:, None, :3])[0]
    if in_place:
        one = in_place == "one_kernel"
        model.use_ring_attention(fused_writes=one, fused_attention=one)
    decoder = StreamingDecoder(model, num_slots=4, max_chunk_frames=15)
    rows = torch.zeros(12, 5, 4, dtype=torch.long, device=DEVICE)  # [nq, rows, T]
    for r, first in enumerate((0, 4, 8, 12)):
        n = min(4, 15 - first)
        rows[:, r, :n] = a[:, first: first + n]
    rows[:, 4, :2] = b[:, :2]
    hop = cfg.downsample_rate
    audio = decoder.decode(rows, torch.tensor([3, 3, 3, 3, 0], device=DEVICE),
                           valid=torch.tensor([4, 4, 4, 3, 2], device=DEVICE),
                           offset=torch.tensor([0, 4, 8, 12, 0], device=DEVICE))
    got_a = torch.cat([audio[r, :, : (4 if r < 3 else 3) * hop] for r in range(4)], dim=-1)
    got_b = audio[4, :, : 2 * hop]
    assert decoder.frames[3].item() == 15 and decoder.frames[0].item() == 2
    last = decoder.decode(torch.stack([a[:, 15:16], b[:, 2:3]], dim=1), torch.tensor([3, 0], device=DEVICE))
    model.use_ring_attention(0)
    got_a, got_b = torch.cat([got_a, last[0]], -1), torch.cat([got_b, last[1]], -1)
    for got, want in ((got_a, want_a), (got_b, want_b)):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= AUDIO_TOL * want.abs().max().item()


def test_a_reference_encoded_through_the_streaming_kernels_gives_the_same_codes():
    """`use_fused_encoder`: two references of different lengths (the shorter padded, as a batch
    is) through the tiny v2 encoder, the whole sequence as one chunk of the streaming kernels,
    against the masked-attention path: the same hidden states (fp32) and the same codes. The
    second clip is longer than every stage's window, so the window is applied, not just causality."""
    cfg = CodecConfig.from_json(tiny_v2_config())
    model = random_codec(cfg, DEVICE, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(11)
    hop = cfg.downsample_rate
    wav = (0.3 * torch.randn(2, cfg.channels, 40 * hop, generator=gen)).to(DEVICE)
    lengths = torch.tensor([23 * hop, 40 * hop], device=DEVICE)
    want = model.encode(wav, lengths, 12)
    model.use_fused_encoder()
    try:
        got = model.encode(wav, lengths, 12)
    finally:
        model.use_fused_encoder(False)
    assert torch.equal(got.lengths, want.lengths)
    scale = want.hidden.abs().max().item()
    assert (got.hidden - want.hidden).abs().max().item() <= AUDIO_TOL * scale
    for row, frames in enumerate(want.lengths.tolist()):
        assert torch.equal(got.codes[:, row, :frames], want.codes[:, row, :frames])
