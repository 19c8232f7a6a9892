"""The codec dispatch planner (`stages.codec.dispatch_plan`): the cost model fits timings, and
the chosen calls are the cheapest contiguous split of the chunks by length."""

import itertools
import random

import pytest

from stages.models.codec.dispatch_plan import CallCost, plan, spread
from stages.models.codec.graphs import bucket

FRAMES = (1, 2, 4, 8, 15)


def cap(n: int) -> int:
    return bucket(n, 256)


def modelled(calls, lengths, cost) -> float:
    return sum(cost(cap(len(members)), T) for T, members in calls)


def test_fit_recovers_the_model():
    true = CallCost(fixed_ms=10.2, row_ms=0.058, row_frame_ms=0.046)
    shapes = [(4, 1), (128, 1), (128, 15)]
    fitted = CallCost.fit(*[(b, t, true(b, t)) for b, t in shapes])
    assert fitted.fixed_ms == pytest.approx(true.fixed_ms)
    assert fitted.row_ms == pytest.approx(true.row_ms)
    assert fitted.row_frame_ms == pytest.approx(true.row_frame_ms)
    with pytest.raises(ValueError):
        CallCost.fit((4, 1, 1.0), (4, 1, 2.0), (4, 15, 3.0))


def test_every_chunk_is_in_exactly_one_call_of_a_long_enough_length():
    lengths = [1, 15, 2, 4, 4, 8, 3, 15, 1, 11]
    calls = plan(lengths, FRAMES, cap, CallCost())
    members = sorted(i for _, m in calls for i in m)
    assert members == list(range(len(lengths)))
    for T, m in calls:
        assert T in FRAMES and all(lengths[i] <= T for i in m)
    assert [T for T, _ in calls] == sorted(T for T, _ in calls)


def test_a_large_fixed_cost_makes_one_call_and_none_makes_one_per_length():
    lengths = [1] * 16 + [2] * 16 + [4] * 16 + [8] * 16 + [15] * 16  # whole buckets: no free padding
    assert [T for T, _ in plan(lengths, FRAMES, cap, CallCost(fixed_ms=1e6))] == [15]
    free = CallCost(fixed_ms=0.0, row_ms=0.0, row_frame_ms=1.0)
    assert [T for T, _ in plan(lengths, FRAMES, cap, free)] == [1, 2, 4, 8, 15]


def test_the_measured_h200_model_splits_a_typical_c128_dispatch_in_two():
    """~9 chunks of each ramp length and 17 steady ones (a C=128 dispatch on the H200): padding
    the short ones to 15 frames costs more than a second call, five calls cost more than two."""
    lengths = [1] * 9 + [2] * 9 + [4] * 9 + [8] * 9 + [15] * 17
    calls = plan(lengths, FRAMES, cap, CallCost())
    assert len(calls) == 2
    assert modelled(calls, lengths, CallCost()) < CallCost()(cap(len(lengths)), 15)


def test_the_plan_is_the_cheapest_contiguous_split():
    rng = random.Random(0)
    cost = CallCost()
    for _ in range(200):
        lengths = [rng.choice([1, 2, 3, 4, 8, 12, 15]) for _ in range(rng.randint(1, 60))]
        got = modelled(plan(lengths, FRAMES, cap, cost), lengths, cost)
        distinct = sorted(set(lengths))
        best = float("inf")
        for cuts in itertools.product([False, True], repeat=len(distinct) - 1):
            total, rows = 0.0, 0
            for k, n in enumerate(distinct):
                rows += lengths.count(n)
                if k == len(distinct) - 1 or cuts[k]:
                    total += cost(cap(rows), next(t for t in FRAMES if t >= n))
                    rows = 0
            best = min(best, total)
        assert got == pytest.approx(best)


def test_lengths_outside_the_calls_are_refused():
    assert plan([], FRAMES, cap, CallCost()) == []
    with pytest.raises(ValueError):
        plan([16], FRAMES, cap, CallCost())
    with pytest.raises(ValueError):
        plan([0, 1], FRAMES, cap, CallCost())


def test_lanes_split_the_costliest_call_while_calls_are_fewer_than_lanes():
    """Side by side, a dispatch takes its slowest lane's time: one call of 16 steady chunks
    becomes two of 8 on two lanes (each models shorter than the whole), three on three; single
    rows, one lane, or enough calls already stay as planned."""
    cost = CallCost(fixed_ms=6.37, row_ms=0.014, row_frame_ms=0.0453)  # the H200 fit, call 19's server
    lengths = [15] * 16
    one = plan(lengths, FRAMES, cap, cost)
    assert [len(m) for _, m in one] == [16]
    two = spread(one, 2, cap, cost)
    assert [(T, len(m)) for T, m in two] == [(15, 8), (15, 8)]
    assert max(cost(cap(len(m)), T) for T, m in two) < cost(16, 15)
    three = spread(one, 3, cap, cost)
    assert sorted(len(m) for _, m in three) == [4, 4, 8]
    for calls in (two, three):  # every chunk in exactly one call
        assert sorted(i for _, m in calls for i in m) == list(range(16))
    assert spread(one, 1, cap, cost) == one
    assert spread([(1, [0]), (15, [1])], 4, cap, cost) == [(1, [0]), (15, [1])]  # nothing to split
    mixed = plan([1] * 6 + [15] * 10, FRAMES, cap, cost)
    assert spread(mixed, len(mixed), cap, cost) == mixed
    # a huge fixed cost: two halves cost as much as the whole minus little, still shorter side by side
    assert len(spread(plan([4] * 32, FRAMES, cap, CallCost(fixed_ms=100.0)), 2, cap, CallCost(fixed_ms=100.0))) == 2
