"""`talker.fused_projections`: a Qwen3 layer's q/k/v and gate/up projections as one matmul each,
with the separate projections' results (up to float32 rounding) and, through a served runner,
the same frames."""

import numpy as np
import torch

from profiles import load_profile
from stages.models.qwen3 import Qwen3Attention, Qwen3MLP, fuse_projections
from stages.models.local_v15.runner import load_talker_runner
from tests.stages.test_local_v15_runner import mixed_requests, run
from tests.stages.test_qwen3 import CFG, make_model


@torch.no_grad()
def test_fused_layers_compute_what_the_separate_projections_did():
    """Whole sequences with left padding (forward_dense) and the paged serving path, before and
    after fusing: the same hidden states; the weights are moved, not copied beside the old ones."""
    model = make_model()
    embeds = torch.randn(2, 9, CFG.hidden_size)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    before = model.forward_dense(embeds, mask)
    params = sum(p.numel() for p in model.parameters())
    assert fuse_projections(model) == 2 * CFG.num_layers
    after = model.forward_dense(embeds, mask)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in model.parameters()) == params
    names = {name for name, _ in model.named_parameters()}
    assert "layers.0.self_attn.qkv_proj.weight" in names and "layers.1.mlp.gate_up_proj.weight" in names
    kinds = {name.split(".")[-2] for name in names if name.startswith("layers.")}
    assert kinds == {"qkv_proj", "o_proj", "q_norm", "k_norm", "gate_up_proj", "down_proj", "input_layernorm",
                     "post_attention_layernorm"}
    assert fuse_projections(model) == 2 * CFG.num_layers  # again: nothing changes
    torch.testing.assert_close(model.forward_dense(embeds, mask), after, rtol=0, atol=0)


@torch.no_grad()
def test_the_stacked_weights_keep_each_projection_in_its_place():
    """q, then k, then v (and gate, then up) along the outputs: each slice of the fused result is
    the projection it replaced, exactly where the shapes are small enough to sum in one order."""
    model = make_model(1)
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    h = torch.randn(5, CFG.hidden_size)
    want = (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
    gate, up = mlp.gate_proj(h), mlp.up_proj(h)
    want_mlp = mlp(h)
    attn.fuse_projections()
    mlp.fuse_projections()
    assert isinstance(attn, Qwen3Attention) and isinstance(mlp, Qwen3MLP)
    got = attn.project(h)
    assert [t.shape[-1] for t in got] == [CFG.num_heads * CFG.head_dim] + [CFG.num_kv_heads * CFG.head_dim] * 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    g, u = mlp.gate_up_proj(h).chunk(2, dim=-1)
    torch.testing.assert_close(g, gate, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(u, up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mlp(h), want_mlp, rtol=1e-5, atol=1e-5)


def test_a_runner_with_fused_projections_makes_the_same_frames(local_v15_dir):
    """Eight requests of mixed settings (sampled, penalised, stops by the model and forced
    lengths) through runners built from the profile with and without the fused projections."""
    reqs = mixed_requests(local_v15_dir)
    frames, finish = {}, {}
    for fused in (False, True):
        runner = load_talker_runner(local_v15_dir, load_profile("cpu", [f"talker.fused_projections={fused}"]), "cpu")
        layers = runner.model.transformer.layers
        assert all((l.self_attn.qkv_proj is not None) == fused and (l.mlp.gate_up_proj is not None) == fused
                   for l in layers)
        frames[fused], finish[fused] = run(runner, reqs)
    assert finish[True] == finish[False] and len(finish[False]) == len(reqs)
    assert sum(len(f) for f in frames[False].values()) >= 20
    for rid in reqs:
        np.testing.assert_array_equal(frames[True][rid], frames[False][rid], err_msg=str(rid))


def test_graph_paths_one_step_ahead_with_both_fused_parts_make_the_plain_frames(local_v15_model, local_v15_dir):
    """As served on CUDA, on the graphs' eager twin: prefill and mixed replays, one step ahead,
    with the projections fused and the KV stores in the layers: every request the frames of the
    plain step-by-step runner over the unfused model."""
    from stages.models.local_v15.loader import load_talker
    from tests.stages.test_mixed_steps import MIXED_MIN_DECODE, make, requests, serve

    reqs = requests(local_v15_dir, MIXED_MIN_DECODE + 3)
    first = {rid: reqs[rid] for rid in range(MIXED_MIN_DECODE)}
    later = {rid: reqs[rid] for rid in range(MIXED_MIN_DECODE, MIXED_MIN_DECODE + 3)}
    want = serve(make(local_v15_model, "eager", 256), first, later)
    fused = load_talker(local_v15_dir)  # its own copy: the shared model stays as loaded
    fuse_projections(fused.transformer)
    fused.transformer.store_kv_in_layers()
    runner = make(fused, "eager", 256, overlap_steps=True)
    got = serve(runner, first, later)
    assert runner.overlap_steps and any(g.keys for g in runner._mixed_sets.values())
    for rid in reqs:
        assert len(got[rid]) == reqs[rid][1].forced_frames
        np.testing.assert_array_equal(got[rid], want[rid], err_msg=str(rid))
