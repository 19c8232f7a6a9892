"""Streaming decode in chunks of any schedule equals the whole decode (within 1e-4, fp32 CPU).

The golden tiny codecs have 1.28 s attention contexts (16 frames at 12.5 Hz), so their 32-frame
(v2) and 40-frame (v1) code sequences run well past every window: exactly where upstream's
context-sized rings drift (docs/model_facts.md, "Golden fixtures": max error 2.8 for v2, 3.1 for v1).
"""

import pytest
import torch

from stages.models.codec.streaming import StreamingDecoder, slot_state_bytes
from tests.conftest import golden_codec, golden_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["v2", "v1"])
def case(request):
    model, cases = golden_codec(golden_dir(f"moss_audio_tokenizer_{request.param}"))
    codes = torch.from_numpy(cases["decode_codes"])  # [nq, 1, T]
    return request.param, model, codes, model.decode(codes)


def schedule(name: str, total: int) -> list[int]:
    seeded = torch.randint(1, 15, (total,), generator=torch.Generator().manual_seed(7)).tolist()
    pattern = {"1/15/15/partial": [1] + [15] * total, "ones": [1] * total, "7/3": [7, 3] * total,
               "whole": [total], "random": seeded}[name]
    out, left = [], total
    for n in pattern:
        if left <= 0:
            break
        out.append(min(n, left))
        left -= out[-1]
    return out


def stream(decoder: StreamingDecoder, codes: torch.Tensor, sizes: list[int], slot: int) -> torch.Tensor:
    parts, begin = [], 0
    for n in sizes:
        parts.append(decoder.decode(codes[:, :, begin: begin + n], torch.tensor([slot])))
        begin += n
    return torch.cat(parts, dim=-1)


@pytest.mark.parametrize("name", ["1/15/15/partial", "ones", "7/3", "whole", "random"])
def test_any_schedule_equals_whole_decode(case, name):
    version, model, codes, whole = case
    decoder = StreamingDecoder(model, num_slots=2, max_chunk_frames=15)
    sizes = schedule(name, codes.shape[-1])
    err = (stream(decoder, codes, sizes, slot=1) - whole).abs().max().item()
    print(f"{version} streaming {name} {sizes[:4]}...: max abs error vs whole {err:.3g}")
    assert err < 1e-4


def test_batched_slots_equal_their_own_whole_decodes(case):
    _, model, codes, whole = case
    other = torch.flip(codes, dims=[-1])  # a different request of the same length
    other_whole = model.decode(other)
    decoder = StreamingDecoder(model, num_slots=4, max_chunk_frames=8)
    both = torch.cat([codes, other], dim=1)  # [nq, 2, T]
    slots = torch.tensor([3, 0])
    parts = [decoder.decode(both[:, :, b: b + 5], slots) for b in range(0, both.shape[-1], 5)]
    audio = torch.cat(parts, dim=-1)
    assert (audio[0:1] - whole).abs().max().item() < 1e-4
    assert (audio[1:2] - other_whole).abs().max().item() < 1e-4


def test_reset_slot_starts_a_fresh_request(case):
    _, model, codes, whole = case
    decoder = StreamingDecoder(model, num_slots=1, max_chunk_frames=15)
    stream(decoder, torch.flip(codes, dims=[-1]), [10, 10], slot=0)  # leave stale history behind
    decoder.reset(torch.tensor([0]))
    again = stream(decoder, codes, schedule("1/15/15/partial", codes.shape[-1]), slot=0)
    assert (again - whole).abs().max().item() < 1e-4


def test_slot_state_bytes_matches_the_allocated_pool(case):
    _, model, _, _ = case
    decoder = StreamingDecoder(model, num_slots=3, max_chunk_frames=15)
    allocated = sum(2 * c.k.numel() * c.k.element_size() for stage in decoder.caches for c in stage)
    assert allocated == 3 * slot_state_bytes(model.cfg, 15, element_size=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("version", ["v2", "v1"])
def test_streaming_equals_whole_on_cuda(version):
    """Same property on the GPU kernels (fp32, TF32 off), on a seeded random tiny codec."""
    from bench.codec import check_exact

    err, rms = check_exact("cuda", version)
    print(f"{version} cuda streaming 1/15/15/9: max abs error {err:.3g} (output RMS {rms:.3g})")
    assert err < 1e-4 * max(1.0, rms)


def test_blocked_whole_attention_equals_the_full_mask(case):
    """Long whole decodes/encodes attend in query blocks (memory linear in T); same result."""
    from stages.models.codec.transformer import WindowPlan

    _, model, _, _ = case
    stage_module = model.decoder[-2]  # the fastest stage, the longest sequences
    stage, layer = stage_module.stage, stage_module.transformer.layers[0]
    x = torch.randn(2, 3 * stage.context + 5, stage.d_model, generator=torch.Generator().manual_seed(0))
    full = layer(x, WindowPlan.whole(2, x.shape[1], stage, x.device, x.dtype, block=0))
    for block in (stage.context - 1, stage.context + 7):
        blocked = layer(x, WindowPlan.whole(2, x.shape[1], stage, x.device, x.dtype, block=block))
        assert (blocked - full).abs().max().item() < 1e-5


def test_long_whole_decode_equals_streaming(case):
    """80 frames: the whole decode's fast stages run blocked; streaming reaches the same audio."""
    _, model, codes, _ = case
    long_codes = torch.cat([codes, torch.flip(codes, dims=[-1]), codes], dim=-1)[:, :, :80]
    whole = model.decode(long_codes)
    decoder = StreamingDecoder(model, num_slots=1, max_chunk_frames=15)
    streamed = stream(decoder, long_codes, schedule("1/15/15/partial", 80), slot=0)
    assert (streamed - whole).abs().max().item() < 1e-4
