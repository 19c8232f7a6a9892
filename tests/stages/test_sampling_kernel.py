"""`sample_tokens_fused` (one Triton kernel a head) draws `sample_tokens`' tokens. With a CUDA
device the compiled kernel runs on it; without one Triton's interpreter runs it on CPU tensors."""

import torch

from tests import triton_cpu  # noqa: F401  (before triton: its CPU interpreter)

import pytest  # noqa: E402

pytest.importorskip("triton")

from stages.runtime.sampling import K_CAP, RowSampling, noise_key, sample_tokens  # noqa: E402
from stages.runtime.sampling_kernel import sample_tokens_fused  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = DEVICE == "cuda"
V = 1024 if CUDA else 128  # the interpreter sorts a 1024-entry row in seconds: a narrower head on CPU


def mixed_rows(batch: int, gen: torch.Generator, top_k: list[int]) -> RowSampling:
    def pick(values, dtype):
        return torch.tensor(values, dtype=dtype)[torch.randint(len(values), (batch,), generator=gen)].to(DEVICE)

    return RowSampling(
        temperature=pick([0.6, 1.0, 1.7, 2.5, 0.0], torch.float32),  # 0: greedy
        top_k=pick(top_k, torch.long),
        top_p=pick([0.3, 0.8, 0.95, 1.0, 0.0], torch.float32),
        repetition_penalty=pick([1.0, 1.1, 1.5], torch.float32),
        greedy=(torch.rand(batch, generator=gen) < 0.1).to(DEVICE),
        seed=torch.randint(-(2**62), 2**62, (batch,), generator=gen).to(DEVICE),
    )


@pytest.mark.parametrize("candidates", [True, False])
def test_one_kernel_draws_the_torch_samplers_tokens(candidates):
    """Random and bf16 (tied) logits, penalties on and off, greedy rows, every top-k and top-p:
    the same tokens as `sample_tokens`, but for rows where rounding decides (the scan's order),
    at most one in a hundred, and those drawn from the row's kept set all the same."""
    gen = torch.Generator().manual_seed(0)
    batch = 64 if CUDA else 16
    top_k = [1, 2, 5, 25, K_CAP] if candidates else [0, 100, 25, V]
    rows = mixed_rows(batch, gen, top_k)
    differ = total = 0
    for step in range(4 if CUDA else 2):
        logits = torch.randn(batch, V, generator=gen) * (1 + step)
        if step % 2:
            logits = logits.to(torch.bfloat16)
        logits = logits.to(DEVICE)
        seen = (torch.rand(batch, V, generator=gen) < 0.05).to(DEVICE) if step < 2 else None
        frame = torch.randint(0, 10_000, (batch,), generator=gen).to(DEVICE)
        key = noise_key(rows.seed, frame, step)
        want = sample_tokens(logits, rows, frame, step, seen, candidates=candidates, key=key)
        got = sample_tokens_fused(logits, rows, key, seen, width=K_CAP if candidates else None)
        assert got.dtype == torch.int64 and got.shape == (batch,)
        differ += int((got != want).sum())
        total += batch
        greedy = rows.greedy | (rows.temperature <= 0)
        scores = logits.float() if seen is None else torch.where(
            seen, torch.where(logits.float() < 0, logits.float() * rows.repetition_penalty[:, None],
                              logits.float() / rows.repetition_penalty[:, None]), logits.float())
        assert torch.equal(got[greedy], scores[greedy].argmax(-1))  # greedy rows: the first argmax
        k = torch.where(rows.top_k > 0, rows.top_k, V).clamp(max=K_CAP if candidates else V)
        kth = scores.sort(-1, descending=True).values.gather(-1, k[:, None] - 1)
        assert bool((scores.gather(-1, got[:, None]) >= kth).all())  # every token within its top-k
    assert differ <= total // 100, (differ, total)


def test_a_rows_token_depends_on_its_own_row_alone():
    """The same rows in another order and in a smaller batch draw the same tokens (batch-invariant)."""
    gen = torch.Generator().manual_seed(1)
    batch = 32 if CUDA else 8
    rows = mixed_rows(batch, gen, [5, 25, K_CAP])
    logits = (torch.randn(batch, V, generator=gen) * 2).to(DEVICE)
    key = noise_key(rows.seed, torch.arange(batch, device=DEVICE), 3)
    whole = sample_tokens_fused(logits, rows, key, width=K_CAP)
    order = torch.randperm(batch, generator=gen).to(DEVICE)[: batch // 2]
    part = RowSampling(**{f: getattr(rows, f)[order] for f in RowSampling.__dataclass_fields__})
    assert torch.equal(sample_tokens_fused(logits[order], part, key[order], width=K_CAP), whole[order])


def test_the_stop_head_two_entries():
    """A 2-entry head (the stop head's continue / stop) samples in the same kernel."""
    gen = torch.Generator().manual_seed(2)
    batch = 16
    rows = mixed_rows(batch, gen, [50])
    logits = (torch.randn(batch, 2, generator=gen) * 3).to(DEVICE)
    frame = torch.arange(batch, device=DEVICE)
    key = noise_key(rows.seed, frame, 12)
    want = sample_tokens(logits, rows, frame, 12, candidates=True, key=key)
    assert torch.equal(sample_tokens_fused(logits, rows, key, width=K_CAP), want)


@pytest.mark.parametrize("graph_path", ["off", "eager"])
def test_a_talker_with_fused_sampling_makes_the_torch_samplers_frames(graph_path, monkeypatch):
    """`LocalV15Runner(fused_sampling=True)` samples every head of every frame (13 a frame) with
    the kernel, on the plain and the graph path, and makes the frames the torch sampler makes
    (a 64-entry codebook: the interpreter's sort of a real 1024-entry head takes seconds a row)."""
    import numpy as np

    import stages.runtime.sampling_kernel as kernel
    from speech.sampling import SamplingParams
    from stages.models.local_v15.config import tiny_config
    from stages.models.local_v15.loader import build_talker_module
    from stages.models.local_v15.runner import LocalV15Runner
    from tests.stages.runner_drive import drive

    cfg = tiny_config()
    cfg["audio_vocab_size"], cfg["audio_codebook_sizes"] = 64, [64] * 12
    torch.manual_seed(0)
    model = build_talker_module(cfg).eval().to(DEVICE)  # the kernel runs where the runner's tensors are
    rng = np.random.default_rng(0)
    arrivals = {}
    for rid, settings in enumerate((dict(temperature=1.7, top_p=0.8, top_k=25), dict(repetition_penalty=1.3))):
        prompt = np.full((12, 13), 1024, np.int64)
        prompt[:, 0] = rng.integers(0, 600, 12)
        arrivals.setdefault(rid, []).append((rid, prompt, SamplingParams(seed=7 + rid, forced_frames=3, **settings)))
    calls = []
    fused = kernel.sample_tokens_fused
    monkeypatch.setattr(kernel, "sample_tokens_fused", lambda *a, **k: calls.append(1) or fused(*a, **k))
    capacity = dict(max_running=4, num_kv_blocks=64, graph_path=graph_path)
    want = drive(LocalV15Runner(model, **capacity), arrivals)
    assert not calls
    got = drive(LocalV15Runner(model, **capacity, fused_sampling=True), arrivals)
    assert len(calls) >= 13 * 3 and len(calls) % 13 == 0  # every head of every frame, nothing else
    assert want.keys() == got.keys()
    for rid in want:
        np.testing.assert_array_equal(got[rid], want[rid])
