"""Outlier channels in random-weight checkpoints (`mossvox make-checkpoint --outlier-channels`): the
backbone's activations carry a few channels 20-100x the rest at every token and massive values at
the chat delimiters, as released LLMs' do, while the MLP's down projection computes the same
product from rows with outliers."""

import pytest
import torch

from stages.models.local_v15.loader import load_talker
from stages.runtime.checkpoint import read_state_dict
from stages.tools.make_checkpoint import make_checkpoint
from stages.tools.outlier_channels import OutlierChannels

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SPEC = OutlierChannels()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(plain, with outliers): tiny Local-v1.5 checkpoints of one seed."""
    root = tmp_path_factory.mktemp("outliers")
    make_checkpoint(root / "plain", size="tiny")
    make_checkpoint(root / "outliers", size="tiny", outliers=SPEC)
    return root / "plain", root / "outliers"


def test_the_gains_span_the_range_and_the_channels_are_fixed():
    gains = SPEC.gains()
    assert gains[0].item() == pytest.approx(20.0) and gains[-1].item() == pytest.approx(100.0)
    assert torch.all(gains[1:] > gains[:-1])
    assert torch.equal(SPEC.channels(64), SPEC.channels(64)) and len(set(SPEC.channels(64).tolist())) == 4


def test_only_the_backbone_tensors_it_names_change(pair):
    plain, outliers = (read_state_dict(d) for d in pair)
    hidden, gains = SPEC.channels(64), SPEC.gains()
    changed = {name for name in plain if not torch.equal(plain[name], outliers[name])}
    layers = {n.split(".")[2] for n in changed if ".layers." in n}
    assert layers == {"0", "1"}
    assert changed == {f"transformer.layers.{i}.{part}" for i in layers for part in
                       ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.up_proj.weight",
                        "mlp.down_proj.weight")} | {"transformer.embed_tokens.weight"}
    norm = "transformer.layers.1.post_attention_layernorm.weight"
    torch.testing.assert_close(outliers[norm][hidden], plain[norm][hidden] * gains)
    rest = torch.ones(64, dtype=torch.bool)
    rest[hidden] = False
    assert torch.equal(outliers[norm][rest], plain[norm][rest])


@torch.no_grad()
def test_the_down_projection_computes_the_same_product(pair):
    """up's outlier rows times the gains, down's columns divided by them: down's input carries
    the outliers, the MLP's output is the same."""
    plain, outliers = (load_talker(d) for d in pair)
    x = torch.randn(5, 64)
    a, b = plain.transformer.layers[0].mlp, outliers.transformer.layers[0].mlp
    torch.testing.assert_close(b(x), a(x), rtol=1e-5, atol=1e-6)
    inner = torch.nn.functional.silu(b.gate_proj(x)) * b.up_proj(x)  # [5, 128]
    others = inner.abs().median(dim=-1).values  # [5]
    assert torch.all(inner[:, SPEC.channels(128)].abs().amax(-1) > 10 * others)


@torch.no_grad()
def test_activations_carry_outlier_channels_and_massive_values_at_the_delimiters(pair):
    """q|k|v's input (each layer's first norm's output) at every token: the outlier channels 20-100x
    the median magnitude of the rest, more at the prompt's first token (<|im_start|>) in the first
    layer: thousands of times."""
    from profiles import load_profile
    from stages.registry import load_variant
    from tests.conftest import speech_job

    model = load_talker(pair[1])
    prompt = load_variant(pair[1], load_profile("cpu")).build_request(speech_job("hello there")).prompt
    seen = []
    for layer in model.transformer.layers:
        layer.self_attn.q_proj.register_forward_hook(lambda m, args, out: seen.append(args[0][0]))
    model.transformer.forward_dense(model.embed_rows(torch.as_tensor(prompt)[None]))
    hidden = SPEC.channels(64)
    rest = torch.ones(64, dtype=torch.bool)
    rest[hidden] = False
    assert prompt[0, 0] == model.config.im_start
    ratios = [x[:, hidden].abs().amax(-1) / x[:, rest].abs().median(dim=-1).values for x in seen]  # [S] a layer
    assert len(ratios) == 2 and all(torch.all(r > 10) for r in ratios), ratios
    assert ratios[0][0] > 1000 and ratios[0][0] > 30 * ratios[0][1:].median(), ratios[0]


def test_make_checkpoint_writes_them_from_the_command_line(pair, tmp_path):
    from cli.main import main

    out = tmp_path / "cli"
    assert main(["make-checkpoint", "--size", "tiny", "--out", str(out), "--outlier-channels"]) == 0
    written, want = read_state_dict(out), read_state_dict(pair[1])
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)
