"""Sampling: upstream filter order on hand-built logits, greedy, per-request seeded noise, the
slots' settings staged and applied together."""

import math

import msgspec
import pytest
import torch

from bench.kernels.sampling import top_k_filter, top_p_filter
from speech.sampling import SamplingParams
from stages.runtime.sampling import RowSampling, SamplingSlots, exponential_noise, sample_tokens


def upstream_filtered_scores(logits, temperature, top_k, top_p, previous, penalty):
    """Straight transcription of upstream v1.5 `_sample_next_token` up to the softmax, one row."""
    scores = logits.float().clone()[None]
    if previous is not None and penalty != 1.0:
        ids = torch.unique(torch.tensor(previous))
        ids = ids[(ids >= 0) & (ids < scores.shape[-1])]
        s = scores[0].index_select(0, ids)
        s = torch.where(s < 0, s * penalty, s / penalty)
        scores[0].scatter_(0, ids, s)
    scores = scores / float(temperature)
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1, None]
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        sorted_mask = cumulative > float(top_p)
        sorted_mask[..., 1:] = sorted_mask[..., :-1].clone()
        sorted_mask[..., 0] = False
        remove = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, sorted_indices, sorted_mask)
        scores = scores.masked_fill(remove, -torch.inf)
    return scores[0]


def ours_filtered_scores(logits, temperature, top_k, top_p, previous, penalty):
    from stages.runtime.sampling import apply_repetition_penalty

    seen = torch.zeros(1, logits.shape[-1], dtype=torch.bool)
    if previous:
        seen[0, previous] = True
    scores = apply_repetition_penalty(logits.float()[None], seen, torch.tensor([penalty]))
    scores = scores / torch.tensor([temperature])[:, None]
    scores = top_k_filter(scores, torch.tensor([top_k]))
    return top_p_filter(scores, torch.tensor([top_p], dtype=torch.float32))[0]


def test_filters_match_upstream_order_on_hand_built_logits():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.2, 1.5, 0.0, -3.0, 2.5, 0.7])
    cases = [
        (1.0, 0, 1.0, None, 1.0),  # no-op
        (1.7, 3, 1.0, None, 1.0),  # top-k only
        (1.0, 0, 0.5, None, 1.0),  # top-p only
        (0.7, 5, 0.8, None, 1.0),
        (1.7, 25, 0.8, [3, 1, 3], 1.3),  # k >= V is a no-op; penalty on a positive and a negative
        (1.2, 4, 0.9, [0, 8, 7], 2.0),  # the penalty reorders the top tokens before top-k
        (1.0, 10, 0.999, [5], 1.1),
    ]
    for case in cases:
        ref = upstream_filtered_scores(logits, *case)
        ours = ours_filtered_scores(logits, *case)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), case
        torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), atol=1e-7, rtol=0)
    # hand-checked: top-k 3 keeps 3.0, 2.5, 2.0; top-p 0.5 keeps the single top token
    assert torch.isfinite(ours_filtered_scores(logits, 1.0, 3, 1.0, None, 1.0)).sum() == 3
    assert torch.isfinite(ours_filtered_scores(logits, 1.0, 0, 0.5, None, 1.0)).sum() == 2
    assert torch.isfinite(ours_filtered_scores(logits, 1.0, 0, 0.3, None, 1.0)).sum() == 1


def rows_for(params: list[SamplingParams]) -> RowSampling:
    slots = SamplingSlots(len(params), "cpu")
    for i, p in enumerate(params):
        slots.write(i, p)
    slots.flush()
    return slots.rows(torch.arange(len(params)))


def test_greedy_is_argmax_after_repetition_penalty():
    logits = torch.tensor([[1.0, 3.0, 2.9, -5.0]])
    seen = torch.tensor([[False, True, False, False]])
    rows = rows_for([SamplingParams(greedy=True, repetition_penalty=1.1)])
    assert sample_tokens(logits, rows, torch.zeros(1, dtype=torch.long), 0, seen).item() == 2
    rows = rows_for([SamplingParams(greedy=True)])
    assert sample_tokens(logits, rows, torch.zeros(1, dtype=torch.long), 0, seen).item() == 1


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 1.5])
    p = SamplingParams(temperature=1.3, top_k=4, top_p=0.9, seed=123)
    target = upstream_filtered_scores(logits, 1.3, 4, 0.9, None, 1.0).softmax(-1)
    n = 4000
    rows = rows_for([p])
    rows = RowSampling(**{k: v.expand(n) for k, v in vars(rows).items()})
    draws = sample_tokens(logits.expand(n, -1), rows, torch.arange(n), stream=3)
    freq = torch.bincount(draws, minlength=6).float() / n
    assert freq[target == 0].sum() == 0  # filtered tokens never drawn
    assert (freq - target).abs().max() < 4 * math.sqrt(0.25 / n)


def test_noise_depends_only_on_seed_frame_stream():
    seed = torch.tensor([5, 7, 5, 2**40 + 5])
    frame = torch.tensor([3, 3, 3, 3])
    e = exponential_noise(seed, frame, 2, 64)
    assert torch.equal(e[0], e[2])
    assert not torch.equal(e[0], e[1]) and not torch.equal(e[0], e[3])
    assert not torch.equal(e[0], exponential_noise(seed[:1], frame[:1] + 1, 2, 64)[0])
    assert not torch.equal(e[0], exponential_noise(seed[:1], frame[:1], 1, 64)[0])
    assert (e > 0).all() and abs(e.mean().item() - 1.0) < 0.2


def test_a_row_samples_the_same_alone_and_in_a_mixed_batch():
    torch.manual_seed(0)
    params = [SamplingParams(seed=s, temperature=t, top_k=k, top_p=p, repetition_penalty=r)
              for s, t, k, p, r in [(11, 1.7, 25, 0.8, 1.0), (3, 1.0, 5, 1.0, 1.2), (11, 0.8, 0, 0.5, 1.0),
                                    (99, 1.7, 25, 0.8, 1.1), (4, 2.0, 50, 0.95, 1.0), (7, 1.0, 1, 1.0, 1.0),
                                    (8, 1.5, 10, 0.7, 1.0), (9, 1.7, 25, 0.8, 1.0)]]
    logits = torch.randn(8, 64) * 2
    seen = torch.rand(8, 64) < 0.1
    frames = torch.arange(8) * 3
    batch = sample_tokens(logits, rows_for(params), frames, 5, seen)
    for i in range(8):
        alone = sample_tokens(logits[i : i + 1], rows_for([params[i]]), frames[i : i + 1], 5, seen[i : i + 1])
        assert alone.item() == batch[i].item()
    # top_k == 1 is greedy on the filtered scores
    assert batch[5].item() == logits[5].argmax().item()


def test_params_round_trip_msgspec():
    p = SamplingParams(seed=42, forced_frames=30)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.text_temperature) == (1.7, 0.8, 25, 1.0, 1.0)


def test_slot_settings_are_staged_then_applied_together():
    """Admissions stage their settings; one flush applies them (the latest write of a slot wins)
    and names the slots written; a step reading a slot before the flush is an error, not a
    sample drawn with the slot's previous request's settings."""
    slots = SamplingSlots(4, "cpu")
    slots.write(2, SamplingParams(temperature=0.5, top_k=7, seed=2**40 + 3))
    slots.write(0, SamplingParams(greedy=True, top_p=0.3, text_top_k=9))
    slots.write(2, SamplingParams(temperature=0.9, top_k=11, repetition_penalty=1.2, seed=5))
    with pytest.raises(RuntimeError, match=r"slots \[0, 2\]"):
        slots.rows(torch.tensor([1]))
    assert sorted(slots.flush().tolist()) == [0, 2]
    assert slots.flush() is None  # nothing staged since
    audio, text = slots.rows(torch.tensor([2, 0, 1])), slots.rows(torch.tensor([2, 0, 1]), text=True)
    assert audio.temperature.tolist() == pytest.approx([0.9, 1.7, 1.0])
    assert audio.top_k.tolist() == [11, 25, 0] and audio.top_p.tolist() == pytest.approx([0.8, 0.3, 1.0])
    assert audio.repetition_penalty.tolist() == pytest.approx([1.2, 1.0, 1.0])
    assert audio.greedy.tolist() == [False, True, False] and audio.seed.tolist() == [5, 0, 0]
    assert text.top_k.tolist() == [50, 9, 0] and text.repetition_penalty.tolist() == [1.0, 1.0, 1.0]
    slots.write(1, SamplingParams(seed=2**62))
    slots.flush()
    assert slots.rows(torch.tensor([1])).seed.item() == 2**62
