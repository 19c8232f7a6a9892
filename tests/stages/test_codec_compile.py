"""`CodecModel.compile_layers`: the codec's layer halves through `torch.compile` trace without
breaking (fullgraph) and give the eager codec's audio (dynamo with the `eager` backend on CPU: the same
operations, traced; inductor itself runs on the GPU)."""

import pytest
import torch

from bench.codec import random_codec
from stages.models.codec.config import CodecConfig, tiny_v1_config, tiny_v2_config
from stages.models.codec.streaming import StreamingDecoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pair(config, device: str = "cpu", backend: str = "eager"):
    cfg = CodecConfig.from_json(config())
    eager = random_codec(cfg, device, torch.float32, seed=5)
    compiled = random_codec(cfg, device, torch.float32, seed=5)
    compiled.compile_layers(backend=backend)
    return cfg, eager, compiled


def streamed(model, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """codes [nq, 2, T] decoded in chunks of `sizes`, the two rows in slots 3 and 1."""
    decoder = StreamingDecoder(model, num_slots=4, max_chunk_frames=15)
    parts, begin = [], 0
    for n in sizes:
        parts.append(decoder.decode(codes[:, :, begin: begin + n], torch.tensor([3, 1])))
        begin += n
    return torch.cat(parts, dim=-1)


@pytest.mark.parametrize("config", [tiny_v2_config, tiny_v1_config])
def test_compiled_layers_give_the_eager_audio(config):
    torch._dynamo.reset()
    cfg, eager, compiled = pair(config)
    codes = torch.randint(0, 1024, (12, 2, 32), generator=torch.Generator().manual_seed(1))
    sizes = [1, 2, 4, 8, 15, 2]
    want = streamed(eager, codes, sizes)
    got = streamed(compiled, codes, sizes)
    assert torch.equal(got, want)
    assert torch.equal(compiled.decode(codes), eager.decode(codes))  # the whole-sequence path too
    wav = torch.randn(1, cfg.channels, 4 * cfg.downsample_rate, generator=torch.Generator().manual_seed(2))
    assert torch.equal(compiled.encode(wav).codes, eager.encode(wav).codes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inductor_compiled_codec_matches_eager_on_cuda():
    """The real compiler on CUDA, fp32 with TF32 off: streaming decode within fp32 reassociation."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    _, eager, compiled = pair(tiny_v2_config, "cuda", "inductor")
    codes = torch.randint(0, 1024, (12, 2, 32), device="cuda")
    sizes = [1, 2, 4, 8, 15, 2]
    want, got = streamed(eager, codes, sizes), streamed(compiled, codes, sizes)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_the_encoder_alone_can_be_compiled():
    """`codec.compile_encoder`: the encoder's layers traced, the decoder's left eager, the same codes."""
    torch._dynamo.reset()
    cfg = CodecConfig.from_json(tiny_v2_config())
    eager = random_codec(cfg, "cpu", torch.float32, seed=5)
    compiled = random_codec(cfg, "cpu", torch.float32, seed=5)
    compiled.compile_layers(backend="eager", decoder=False)
    stacks = {name: [m.transformer.parts for m in getattr(compiled, name) if hasattr(m, "transformer")]
              for name in ("encoder", "decoder")}
    plain = eager.decoder[0].transformer.parts  # the eager halves
    assert stacks["encoder"] and all(parts != plain for parts in stacks["encoder"])  # compiled
    assert stacks["decoder"] and all(parts == plain for parts in stacks["decoder"])  # untouched
    wav = torch.randn(2, cfg.channels, 5 * cfg.downsample_rate, generator=torch.Generator().manual_seed(2))
    assert torch.equal(compiled.encode(wav).codes, eager.encode(wav).codes)
