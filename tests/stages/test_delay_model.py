"""Delay network: strict loading and teacher-forced parity with upstream on the golden fixtures."""

import numpy as np
import pytest
import torch

from stages.models.delay.config import DelayConfig, full_size_config, tiny_config
from stages.models.delay.model import DelayModel
from stages.runtime.checkpoint import CheckpointError, load_weights, read_state_dict
from tests.conftest import golden_case, golden_dir

GOLDEN = golden_dir("moss_tts_delay")
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def model() -> DelayModel:
    return DelayModel.from_dir(GOLDEN)


def golden(name: str) -> dict[str, np.ndarray]:
    return golden_case(GOLDEN, name)


@pytest.mark.parametrize("name", ["plain", "voice_clone", "continuation"])
def test_teacher_forced_parity(model, name):
    g = golden(name)
    ids = torch.from_numpy(g["tf_input_ids"])[None]
    with torch.no_grad():
        hidden = model.forward_dense(ids)[0]
        text = model.text_logits(hidden)
        audio = model.audio_logits(hidden)
    np.testing.assert_allclose(hidden.numpy(), g["tf_last_hidden"], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(text.numpy(), g["tf_text_logits"], atol=ATOL, rtol=RTOL)
    want = g["tf_audio_logits"]
    assert np.isneginf(audio.numpy()[..., -1]).all() and np.isneginf(want[..., -1]).all()
    np.testing.assert_allclose(audio.numpy()[..., :-1], want[..., :-1], atol=ATOL, rtol=RTOL)


def test_unfused_and_fused_paths_agree(model):
    ids = torch.from_numpy(golden("plain")["tf_input_ids"])[None]
    unfused = DelayModel(model.config)
    unfused.load_state_dict(model.state_dict())
    with torch.no_grad():
        a = model.audio_logits(model.forward_dense(ids))
        b = unfused.audio_logits(unfused.forward_dense(ids))
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_loader_names_missing_and_extra_tensors():
    state = read_state_dict(GOLDEN)
    state.pop("emb_ext.3.weight")
    state["lm_heads.99.weight"] = torch.zeros(1)
    with torch.device("meta"):
        m = DelayModel(DelayConfig.from_dict(__import__("json").loads((GOLDEN / "config.json").read_text())))
    m = m.to_empty(device="cpu")
    with pytest.raises(CheckpointError) as err:
        load_weights(m, state)
    assert "emb_ext.3.weight" in str(err.value) and "lm_heads.99.weight" in str(err.value)


def count_params(config: dict) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in DelayModel(DelayConfig.from_dict(config)).parameters())


def test_full_size_parameter_counts():
    # docs/model_facts.md, "Delay family": MOSS-TTS v1.5 = 8.490 B parameters (16,979,683,328 bytes in bf16)
    assert count_params(full_size_config("moss-tts")) * 2 == 16_979_683_328
    assert 8.3e9 < count_params(full_size_config("ttsd")) < 8.49e9
    assert 1.7e9 < count_params(full_size_config("voice-generator")) < 2.2e9
    assert count_params(tiny_config()) < 5e6


def test_fused_sglang_names_load(model):
    """`MossTTSDelayWithCodec` checkpoints call the backbone `model.` and carry `codec_model.*`."""
    from stages.models.delay.model import CHECKPOINT_IGNORED, CHECKPOINT_RENAMES

    state = {k.replace("language_model.", "model.", 1): v for k, v in read_state_dict(GOLDEN).items()}
    state["codec_model.decoder.0.weight"] = torch.zeros(2)
    with torch.device("meta"):
        fused = DelayModel(model.config)
    fused = fused.to_empty(device="cpu")
    load_weights(fused, state, rename=CHECKPOINT_RENAMES, ignore=CHECKPOINT_IGNORED)
    torch.testing.assert_close(fused.language_model.norm.weight, model.language_model.norm.weight)
