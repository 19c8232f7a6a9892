"""MOSS-Audio-Tokenizer v1 (24 kHz mono) reproduces upstream on the golden tiny codec.

Waveforms within 1e-3 (output RMS ~5.6), hidden states within 1e-4, codes exactly. The weights are
seeded random (no real checkpoint is reachable).
"""

import numpy as np
import pytest
import torch

from stages.models.codec import CodecConfig, count_parameters, full_size_v1_config, load_codec
from tests.conftest import golden_dir, golden_error

GOLDEN = golden_dir("moss_audio_tokenizer_v1")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return load_codec(GOLDEN)


@pytest.fixture(scope="module")
def g():
    return dict(np.load(GOLDEN / "cases.npz"))


def report(name: str, got: np.ndarray, want: np.ndarray) -> float:
    return golden_error(f"v1 {name}", got, want)


def test_config_is_v1(model):
    cfg = model.cfg
    assert (cfg.version, cfg.channels, cfg.stream_hop) == ("v1", 1, 1920)
    contexts = [s.context for s in cfg.encoder + cfg.decoder if hasattr(s, "context")]
    assert contexts == [128, 64, 32, 16, 16, 32, 64, 128]  # cases.json, int()
    # v1 drops projections whose dims are equal (decoder.0: d_model 48 -> output 48)
    assert isinstance(model.decoder[0].output_proj, torch.nn.Identity)


def test_v1_config_with_a_dtype_key_stays_v1():
    import json

    cfg = json.loads((GOLDEN / "config.json").read_text())
    cfg["codec_weight_dtype"] = "bf16"  # written by make-checkpoint into either version
    assert CodecConfig.from_json(cfg).version == "v1"


def test_decode(model, g):
    audio = model.decode(torch.from_numpy(g["decode_codes"]))
    assert report("decode_audio", audio.numpy(), g["decode_audio"]) < 1e-3
    assert audio.shape[-1] == g["decode_audio_lengths"][0]


def test_decode_nq16_prefix(model, g):
    codes = torch.from_numpy(g["decode_codes"])[:16]
    assert report("decode_nq16_audio", model.decode(codes).numpy(), g["decode_nq16_audio"]) < 1e-3


def test_decode_first16(model, g):
    codes = torch.from_numpy(g["decode_codes"])[:, :, :16]
    assert report("decode_first16_audio", model.decode(codes).numpy(), g["decode_first16_audio"]) < 1e-3


def test_encode(model, g):
    wav = torch.from_numpy(g["encode_input_waveform"])[None]  # [1, 1, 37000]
    out = model.encode(wav)
    assert report("encode_encoder_hidden_states", out.hidden.numpy(), g["encode_encoder_hidden_states"]) < 1e-4
    assert np.array_equal(out.codes.numpy(), g["encode_audio_codes"])
    assert np.array_equal(out.lengths.numpy(), g["encode_audio_codes_lengths"])
    nq16 = model.encode(wav, num_quantizers=16)
    assert np.array_equal(nq16.codes.numpy(), g["encode_nq16_audio_codes"])


def test_batch_decode(model, g):
    codes = torch.from_numpy(g["decode_codes"])[:, 0]
    audio, lengths = model.batch_decode([codes[:, :40], codes[:, :25]])
    assert report("batch_decode_audio", audio.numpy(), g["batch_decode_audio"]) < 1e-3
    assert np.array_equal(lengths.numpy(), g["batch_decode_audio_lengths"])


def test_full_size_v1_parameter_count():
    n = count_parameters(CodecConfig.from_json(full_size_v1_config()))
    print(f"full-size v1 codec parameters: {n:,}")
    assert 1.76e9 < n < 1.79e9  # docs/model_facts.md, "Codec": 1.775 B
