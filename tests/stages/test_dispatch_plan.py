"""The codec dispatch planner (`stages.codec.dispatch_plan`): the cost model fits timings, and
the chosen calls are the cheapest contiguous split of the chunks by length."""

import itertools
import random

import pytest

from stages.models.codec.dispatch_plan import CallCost, plan, plan_pieces, spread
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
    cost = CallCost(fixed_ms=6.37, row_ms=0.014, row_frame_ms=0.0453)  # a served H200 codec's fit at warm-up
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


SERVED = CallCost(fixed_ms=6.33, row_ms=0.013, row_frame_ms=0.0452)  # the H200 fit with ring attention


def rows_of(calls) -> int:
    return sum(len(rows) for _, rows in calls)


@pytest.mark.parametrize("seed", range(20))
def test_pieces_cover_every_chunk_in_order_in_one_call(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, 3, 4, 7, 8, 15]) for _ in range(rng.randint(1, 40))]
    cost = CallCost(fixed_ms=rng.choice([0.0, 6.33, 1e3]), row_ms=rng.choice([0.0, 0.013, 0.5]),
                    row_frame_ms=0.0452)
    calls = plan_pieces(lengths, FRAMES, cap, cost, max_rows=64, max_span=16)
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for T, rows in calls:
        assert T in FRAMES and 1 <= len(rows) <= 64
        for m, first, n in rows:
            assert 1 <= n <= T
            assert m not in seen or seen[m][0][0] == T  # a chunk's pieces stay in one call
            seen.setdefault(m, []).append((T, first, n))
    assert sorted(seen) == list(range(len(lengths)))
    for m, pieces in seen.items():  # in order, end to end, every piece but the last full
        assert [first for _, first, _ in pieces] == list(range(0, lengths[m], pieces[0][0]))
        assert sum(n for _, _, n in pieces) == lengths[m]
        assert len(pieces) == 1 or len(pieces) * pieces[0][0] <= 16  # within the ring headroom
    assert [T for T, _ in calls] == sorted(T for T, _ in calls)
    # cutting is one more option: never costlier than padding (`plan`)
    assert modelled(calls, lengths, cost) <= modelled(plan(lengths, FRAMES, cap, cost), lengths, cost) + 1e-9


def test_the_served_model_cuts_a_typical_c128_dispatch_into_one_short_call():
    """27 chunks of a C=128 dispatch (5 each of the ramp's 1, 2, 4, 8 frames, 7 steady of 15):
    padded, two calls model 26.8 ms; cut into 2-frame rows, one call of 96 rows models 16.3."""
    lengths = [1] * 5 + [2] * 5 + [4] * 5 + [8] * 5 + [15] * 7
    padded = plan(lengths, FRAMES, cap, SERVED)
    cut = plan_pieces(lengths, FRAMES, cap, SERVED, max_rows=256, max_span=16)
    assert [(T, len(m)) for T, m in padded] == [(4, 15), (15, 12)]
    assert [(T, len(rows)) for T, rows in cut] == [(2, 96)]
    assert modelled(cut, lengths, SERVED) == pytest.approx(16.26, abs=0.01)
    assert modelled(padded, lengths, SERVED) == pytest.approx(26.82, abs=0.01)


def test_no_call_holds_more_rows_than_its_cap():
    """Cut 2-frame rows would pay here (as above), but 27 chunks in at most 48 rows a call leave
    the planner fewer cuts; more chunks than the cap cannot go in at all."""
    lengths = [1] * 5 + [2] * 5 + [4] * 5 + [8] * 5 + [15] * 7
    calls = plan_pieces(lengths, FRAMES, cap, SERVED, max_rows=48, max_span=16)
    assert all(len(rows) <= 48 for _, rows in calls)
    assert rows_of(calls) > len(lengths)  # still cut somewhere
    with pytest.raises(ValueError):
        plan_pieces([1] * 5, FRAMES, cap, SERVED, max_rows=4, max_span=16)


def test_cuts_stay_within_the_ring_headroom():
    """With rings of exactly the longest chunk's headroom (15 frames) a 15-frame chunk cut into
    2-frame rows would pad its last row to frame 16, over keys its first row still reads: only
    1-frame rows (15 of them, no padding) or the whole chunk are allowed."""
    lengths = [1] * 5 + [2] * 5 + [4] * 5 + [8] * 5 + [15] * 7
    for T, rows in plan_pieces(lengths, FRAMES, cap, SERVED, max_rows=256, max_span=15):
        for m, first, n in rows:
            assert lengths[m] <= T or -(-lengths[m] // T) * T <= 15, (T, lengths[m])
            assert lengths[m] != 15 or T in (1, 15)
