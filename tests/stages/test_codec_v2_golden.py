"""MOSS-Audio-Tokenizer v2 (48 kHz stereo) reproduces upstream (vllm-omni copy) on the golden tiny codec.

Waveforms within 1e-3 (output RMS ~3), hidden states within 1e-4, codes exactly. The weights are
seeded random (no real checkpoint is reachable).
"""

import numpy as np
import pytest
import torch

from stages.models.codec import CodecConfig, build_codec, count_parameters, full_size_v2_config, load_codec, tiny_v2_config
from stages.models.codec.loader import CODEC_RENAMES
from stages.runtime.checkpoint import CheckpointError, load_weights, read_state_dict
from tests.conftest import golden_dir, golden_error

GOLDEN = golden_dir("moss_audio_tokenizer_v2")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return load_codec(GOLDEN)


@pytest.fixture(scope="module")
def g():
    return dict(np.load(GOLDEN / "cases.npz"))


def report(name: str, got: np.ndarray, want: np.ndarray) -> float:
    return golden_error(f"v2 {name}", got, want)


def test_config_is_v2(model):
    cfg = model.cfg
    assert (cfg.version, cfg.channels, cfg.interleave, cfg.stream_hop) == ("v2", 2, True, 7680)
    contexts = [s.context for s in cfg.encoder + cfg.decoder if hasattr(s, "context")]
    assert contexts == [512, 256, 128, 64, 32, 16, 16, 32, 64, 128, 256, 512]  # cases.json, round()


def test_decode(model, g):
    audio = model.decode(torch.from_numpy(g["decode_codes"]))
    assert report("decode_audio", audio.numpy(), g["decode_audio"]) < 1e-3
    assert audio.shape[-1] == g["decode_audio_lengths"][0]


def test_decode_nq12_prefix(model, g):
    codes = torch.from_numpy(g["decode_codes"])[:12, :, :16]
    assert report("decode_nq12_audio", model.decode(codes).numpy(), g["decode_nq12_audio"]) < 1e-3


def test_encode(model, g):
    wav = torch.from_numpy(g["encode_input_waveform"])[None]  # [1, 2, 74000]
    out = model.encode(wav)
    assert report("encode_encoder_hidden_states", out.hidden.numpy(), g["encode_encoder_hidden_states"]) < 1e-4
    assert np.array_equal(out.codes.numpy(), g["encode_audio_codes"])
    assert np.array_equal(out.lengths.numpy(), g["encode_audio_codes_lengths"])
    nq12 = model.encode(wav, num_quantizers=12)
    assert np.array_equal(nq12.codes.numpy(), g["encode_nq12_audio_codes"])


def test_batch_decode(model, g):
    codes = torch.from_numpy(g["decode_codes"])[:, 0]
    audio, lengths = model.batch_decode([codes[:, :16], codes[:, :10]])
    assert report("batch_decode_audio", audio.numpy(), g["batch_decode_audio"]) < 1e-3
    assert np.array_equal(lengths.numpy(), g["batch_decode_audio_lengths"])


def test_mono_input_is_rejected(model):
    with pytest.raises(ValueError, match="2 channel"):
        model.encode(torch.zeros(1, 1, 3840))


def test_loader_accepts_ffn_and_in_proj_spellings(g):
    state = read_state_dict(GOLDEN)
    respelled = {}
    for name, t in state.items():
        name = name.replace(".linear1.", ".ffn.0.").replace(".linear2.", ".ffn.2.")
        name = name.replace(".self_attn.in_projs.0.", ".self_attn.in_proj.")
        respelled[name] = t
    model = build_codec(CodecConfig.from_json(tiny_v2_config()))
    load_weights(model, respelled, rename=CODEC_RENAMES)
    audio = model.decode(torch.from_numpy(g["decode_codes"])[:, :, :4])
    assert np.abs(audio.numpy() - g["decode_audio"][..., : audio.shape[-1]]).max() < 1e-3


def test_loader_names_missing_and_extra_tensors():
    state = read_state_dict(GOLDEN)
    state.pop("decoder.0.output_proj.weight")
    state["decoder.0.bogus.weight"] = torch.zeros(1)
    model = build_codec(CodecConfig.from_json(tiny_v2_config()))
    with pytest.raises(CheckpointError, match=r"decoder\.0\.output_proj\.weight.*decoder\.0\.bogus\.weight"):
        load_weights(model, state, rename=CODEC_RENAMES)


def test_full_size_v2_parameter_count():
    n = count_parameters(CodecConfig.from_json(full_size_v2_config()))
    print(f"full-size v2 codec parameters: {n:,}")
    assert 2.10e9 < n < 2.14e9  # docs/model_facts.md, "Codec": ~2.12 B
