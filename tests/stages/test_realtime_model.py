"""Realtime network: strict loading and teacher-forced parity with upstream on the golden fixtures."""

import numpy as np
import pytest
import torch

from stages.models.realtime.config import RealtimeConfig, full_size_config, tiny_config
from stages.models.realtime.model import UNUSED_CHECKPOINT_TENSORS, RealtimeModel
from stages.runtime.checkpoint import CheckpointError, load_weights, read_state_dict
from tests.conftest import golden_case, golden_dir

GOLDEN = golden_dir("moss_tts_realtime")
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module")
def model() -> RealtimeModel:
    return RealtimeModel.from_dir(GOLDEN)


def golden(name: str) -> dict[str, np.ndarray]:
    return golden_case(GOLDEN, name)


@pytest.mark.parametrize("name", ["plain", "voice_clone"])
def test_teacher_forced_parity(model, name):
    g = golden(name)
    with torch.no_grad():
        hidden = model.forward_dense(torch.from_numpy(g["tf_input_ids"])[None])[0]  # [S, H]
        positions = torch.from_numpy(g["tf_label_positions"])
        labels = torch.from_numpy(g["tf_labels"])[positions, 1:]  # [N, 16]
        # row n predicts the codes of row p from the backbone hidden state of row p - 1
        logits = model.local_transformer.forward_dense(hidden[(positions - 1).clamp(min=0)], labels[:, :-1])
    np.testing.assert_allclose(hidden.numpy(), g["tf_backbone_last_hidden"], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(logits.numpy(), g["tf_local_logits"], atol=ATOL, rtol=RTOL)


def test_step_path_equals_dense_path(model):
    g = golden("plain")
    torch.manual_seed(0)
    hidden = torch.randn(3, 16)
    codes = torch.randint(0, 1024, (3, 15))
    with torch.no_grad():
        dense = model.local_transformer.forward_dense(hidden, codes)
        kv = model.local_transformer.new_kv(3, torch.float32, torch.device("cpu"))
        x, steps = hidden, []
        for i in range(16):
            steps.append(model.local_transformer.step(x, i, kv))
            if i < 15:
                x = model.local_transformer.embed_code(i, codes[:, i])
    torch.testing.assert_close(torch.stack(steps, 1), dense, atol=1e-5, rtol=1e-5)
    assert g["tf_local_logits"].shape[-1] == dense.shape[-1]


def test_unused_backbone_table_is_ignored_and_other_problems_are_named():
    state = read_state_dict(GOLDEN)
    assert "language_model.embed_tokens.weight" in state  # stored upstream, unused
    state.pop("local_transformer.local_lm_heads.3.weight")
    with torch.device("meta"):
        m = RealtimeModel(RealtimeConfig.from_dict(__import__("json").loads((GOLDEN / "config.json").read_text())))
    m = m.to_empty(device="cpu")
    with pytest.raises(CheckpointError) as err:
        load_weights(m, state, ignore=UNUSED_CHECKPOINT_TENSORS)
    assert "local_transformer.local_lm_heads.3.weight" in str(err.value)
    assert "language_model.embed_tokens" not in str(err.value)


def test_parameter_counts():
    def count(cfg):
        with torch.device("meta"):
            m = RealtimeModel(RealtimeConfig.from_dict(cfg))
        return sum(p.numel() for p in m.parameters()), sum(p.numel() for p in m.local_transformer.model.layers.parameters())

    total, local_layers = count(full_size_config())
    assert 195e6 < local_layers < 205e6  # upstream's "200M" depth transformer (docs/model_facts.md, "Realtime": 201 M)
    assert 2.0e9 < total < 2.4e9
    assert count(tiny_config())[0] < 2e6


def test_padding_rows_are_zeroed_on_load_as_upstream(tmp_path):
    import shutil

    from safetensors.torch import save_file

    state = read_state_dict(GOLDEN)
    state["embed_tokens.0.weight"][605] = 1.0
    state["embed_tokens.3.weight"][1024] = 1.0
    state["local_transformer.model.embed_tokens.2.weight"][1024] = 1.0
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(GOLDEN / name, tmp_path / name)
    save_file(state, str(tmp_path / "model.safetensors"))
    m = RealtimeModel.from_dir(tmp_path)
    assert m.embed_tokens[0].weight[605].abs().sum() == 0 and m.embed_tokens[3].weight[1024].abs().sum() == 0
    assert (m.local_transformer.model.embed_tokens[2].weight[1024] == 1.0).all()  # untouched, as upstream
