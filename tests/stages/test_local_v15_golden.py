"""Local-v1.5 talker parity with upstream on the golden fixtures (random tiny weights).

Greedy generation from the golden prompt ids must give the same codes, frame count and stop
decision; the teacher-forced global hidden states and local logits must agree within 1e-4.
The largest error seen per array is printed (`pytest -s`).
"""

import numpy as np
import pytest
import torch

from stages.models.local_v15.config import LocalV15Config
from stages.models.local_v15.loader import load_talker
from stages.models.local_v15.model import GreedyFrameSampler
from tests.conftest import golden_dir

CASES = ("plain", "voice_clone", "continuation")
MAX_NEW_FRAMES = 16  # cases.json generate_kwargs


@pytest.fixture(scope="module")
def golden():
    return golden_dir("moss_tts_local_v1_5")


@pytest.fixture(scope="module")
def model(golden):
    torch.manual_seed(0)
    return load_talker(golden)


def load_case(golden, name: str) -> dict[str, np.ndarray]:
    with np.load(golden / f"case_{name}.npz") as z:
        return {k: z[k] for k in z.files}


@torch.no_grad()
def generate_dense(model, prompt: np.ndarray, max_new_frames: int) -> tuple[list[np.ndarray], bool]:
    """Reference greedy loop without any cache: re-run the whole sequence every frame."""
    cfg: LocalV15Config = model.config
    rows = torch.from_numpy(prompt)
    frames = []
    for _ in range(max_new_frames):
        h = model.transformer.forward_dense(model.embed_rows(rows)[None])[0, -1]
        stop, codes = model.decode_frame(h[None], GreedyFrameSampler())
        if stop.item():
            return frames, True
        frames.append(codes[0].numpy())
        rows = torch.cat([rows, torch.cat([torch.tensor([cfg.gen_slot]), codes[0]])[None]])
    return frames, False


@pytest.mark.parametrize("name", CASES)
def test_greedy_generation_matches_upstream(model, golden, name):
    case = load_case(golden, name)
    assert case["attention_mask"].all()
    frames, stopped = generate_dense(model, case["input_ids"], MAX_NEW_FRAMES)
    assert len(frames) == int(case["num_generated_frames"])
    assert stopped == bool(case["stopped"])
    np.testing.assert_array_equal(np.array(frames).reshape(-1, 12), case["generated_audio_codes"])
    gen_rows = case["generation_ids"][-len(frames):] if frames else case["generation_ids"][:0]
    assert (gen_rows[:, 0] == model.config.gen_slot).all()
    np.testing.assert_array_equal(gen_rows[:, 1:], case["generated_audio_codes"])


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_teacher_forced_hidden_and_logits(model, golden, name):
    case = load_case(golden, name)
    ids = torch.from_numpy(case["tf_input_ids"])
    hidden = model.transformer.forward_dense(model.embed_rows(ids)[None])[0]  # [T, H]
    labels = torch.from_numpy(case["tf_labels"])  # [T, 13]: next row; audio pad / ignore -> invalid
    text_logits, audio_logits = model.teacher_forced_logits(hidden, labels[:, 1:])
    errors = {}
    for key, ours in (("tf_global_hidden", hidden), ("tf_text_logits", text_logits), ("tf_audio_logits", audio_logits)):
        ref = torch.from_numpy(case[key])
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(ours)), key
        errors[key] = (ours[finite] - ref[finite]).abs().max().item()
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4, msg=key)
    print(f"\n[{name}] max abs error: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))


# ---- checkpoint shapes and loading --------------------------------------------------------------


def test_full_size_parameter_count():
    """The released shapes (Qwen3-4B + one 2560-wide gpt2 block, tied heads): about 4.13 B."""
    from stages.models.local_v15.config import full_size_config
    from stages.models.local_v15.loader import build_talker_module

    with torch.device("meta"):
        model = build_talker_module(full_size_config())
    n = sum(p.numel() for p in model.parameters())
    print(f"\nfull-size v1.5 talker parameters: {n:,}")
    assert n == 4_129_990_144
    assert model.local_transformer.h[0].attn.head_dim == 80


def test_tiny_config_builds_and_generates():
    from speech.sampling import SamplingParams
    from stages.models.local_v15.config import tiny_config
    from stages.models.local_v15.loader import build_talker_module
    from stages.models.local_v15.runner import LocalV15Runner

    torch.manual_seed(0)
    model = build_talker_module(tiny_config())
    cfg = model.config
    assert (cfg.hidden_size, cfg.codebook_size, cfg.n_vq, cfg.local.num_heads) == (64, 1024, 12, 4)
    runner = LocalV15Runner(model, max_running=1, num_kv_blocks=8)
    prompt = np.full((5, 13), cfg.audio_pad_code, dtype=np.int64)
    prompt[:, 0] = [cfg.im_start, 10, 11, 12, cfg.audio_start]
    runner.add(0, prompt, SamplingParams(seed=3, forced_frames=3))
    events = [ev for _ in range(3) for ev in runner.step()]
    assert [ev.finished for ev in events] == [False, False, True]
    assert all(ev.codes.shape == (12,) and (0 <= ev.codes).all() and (ev.codes < 1024).all() for ev in events)


def test_loader_is_strict_and_accepts_tied_copies(golden, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from stages.runtime.checkpoint import CheckpointError

    state = load_file(str(golden / "model.safetensors"))
    shutil.copy(golden / "config.json", tmp_path / "config.json")

    def write(tensors):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))

    # tied copies stored explicitly (not dropped by save_pretrained): accepted
    write({**state, "audio_lm_heads.3.weight": state["audio_embeddings.3.weight"].clone(),
           "text_lm_head.weight": state["transformer.embed_tokens.weight"].clone()})
    load_talker(tmp_path)
    missing = dict(state)
    del missing["local_text_lm_head.weight"]
    write({**missing, "local_transformer.h.0.extra": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"local_text_lm_head\.weight.*local_transformer\.h\.0\.extra"):
        load_talker(tmp_path)
    write({**state, "audio_embeddings.0.weight": torch.zeros(65, 32)})
    with pytest.raises(CheckpointError, match=r"audio_embeddings\.0\.weight: checkpoint \(65, 32\)"):
        load_talker(tmp_path)
