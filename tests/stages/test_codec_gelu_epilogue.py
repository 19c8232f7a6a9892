"""`codec.gelu_epilogue`: the decoder layers' FFN GELU as the tanh approximation (on CUDA in the
first matmul's cuBLASLt epilogue): the decoder's audio close to the erf GELU's, streaming still
equal to the whole decode, the encoder and the checkpoint's tensors untouched, and the profile
turning it on."""

import pytest
import torch
import torch.nn.functional as F

from profiles import load_profile
from stages.models.codec.streaming import StreamingDecoder
from stages.models.codec.transformer import ProjectedTransformer, feed_forward
from tests.conftest import golden_codec, golden_dir
from tests.stages.test_codec_streaming import schedule, stream

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def v2():
    model, cases = golden_codec(golden_dir("moss_audio_tokenizer_v2"))
    return model, torch.from_numpy(cases["decode_codes"])  # [nq, 1, T]


def _decoder_layers(model):
    return [layer for m in model.decoder if isinstance(m, ProjectedTransformer) for layer in m.transformer.layers]


def test_the_tanh_gelu_moves_the_audio_little_and_streams_exactly(v2):
    model, codes = v2
    keys = set(model.state_dict())
    erf = model.decode(codes)
    model.use_gelu_epilogue()
    try:
        assert set(model.state_dict()) == keys  # no tensor of its own in a checkpoint
        tanh = model.decode(codes)
        rel = ((tanh - erf).norm() / erf.norm()).item()
        assert 0 < rel < 1e-2, rel  # another GELU, close to it
        decoder = StreamingDecoder(model, num_slots=2, max_chunk_frames=15)
        streamed = stream(decoder, codes, schedule("1/15/15/partial", codes.shape[-1]), slot=1)
        assert (streamed - tanh).abs().max().item() < 1e-4
    finally:
        model.use_gelu_epilogue(False)
    assert all(layer.gelu_epilogue is None for layer in _decoder_layers(model))
    torch.testing.assert_close(model.decode(codes), erf, rtol=0, atol=0)


def test_only_the_decoder_takes_it(v2):
    model, _ = v2
    wav = torch.randn(1, model.cfg.channels, 4 * model.cfg.downsample_rate, generator=torch.Generator().manual_seed(3))
    before = model.encode(wav).codes
    model.use_gelu_epilogue()
    try:
        encoder_layers = [layer for m in model.encoder if isinstance(m, ProjectedTransformer)
                          for layer in m.transformer.layers]
        assert encoder_layers and all(layer.gelu_epilogue is None for layer in encoder_layers)
        assert all(layer.gelu_epilogue is not None for layer in _decoder_layers(model))
        assert torch.equal(model.encode(wav).codes, before)
    finally:
        model.use_gelu_epilogue(False)


def test_the_profile_turns_it_on(v2):
    from stages.models.codec.serving import make_codec_runner

    runner = make_codec_runner(golden_dir("moss_audio_tokenizer_v2"), load_profile("cpu", ["codec.gelu_epilogue=true"]),
                               "cpu", n_vq=4)
    assert all(layer.gelu_epilogue is not None for layer in _decoder_layers(runner.model))
    runner = make_codec_runner(golden_dir("moss_audio_tokenizer_v2"), load_profile("cpu"), "cpu", n_vq=4)
    assert all(layer.gelu_epilogue is None for layer in _decoder_layers(runner.model))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_epilogue_is_the_tanh_gelu_of_the_product(dtype):
    """cuBLASLt's GELU epilogue against the product and torch's tanh GELU apart, on rows of the
    shapes a replay has (flattened [B, T]), a layer of the full v2 decoder's 768-wide stages."""
    from stages.models.codec.transformer import TransformerLayer

    torch.manual_seed(0)
    layer = TransformerLayer(768, 12, 3072).to("cuda", dtype)
    layer.gelu_epilogue = torch.zeros(3072, device="cuda", dtype=dtype)
    x = torch.randn(3, 5, 768, device="cuda", dtype=dtype)
    want = layer.linear2(F.gelu(layer.linear1(x), approximate="tanh"))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(feed_forward(layer, x), want, rtol=tol, atol=tol)
