"""Coalescing window decisions, driven by an explicit clock (no sleeps)."""

import pytest

from stages.runtime.coalescer import Coalescer


def test_waits_for_min_batch_then_dispatches_all_ready() -> None:
    c = Coalescer(min_batch=4, max_wait_s=0.010)
    for i, rid in enumerate((1, 2, 3)):
        c.mark_ready(rid, since=i * 0.001)
    d = c.decide(now=0.003, alive=8)
    assert d.dispatch == () and d.wait_s == pytest.approx(0.007)
    c.mark_ready(4, since=0.004)
    d = c.decide(now=0.004, alive=8)
    assert d.dispatch == (1, 2, 3, 4)
    assert c.num_ready == 0


def test_max_wait_since_oldest_ready_chunk() -> None:
    c = Coalescer(min_batch=4, max_wait_s=0.010)
    c.mark_ready(7, since=1.000)
    c.mark_ready(8, since=1.005)
    assert c.decide(now=1.009, alive=8).dispatch == ()
    assert c.decide(now=1.010, alive=8).dispatch == (7, 8)


def test_idle_wait_dispatches_at_once_when_no_more_streams_can_join() -> None:
    c = Coalescer(min_batch=4, max_wait_s=0.010, policy="idle_wait")
    c.mark_ready(1, since=0.0)
    assert c.decide(now=0.0, alive=1).dispatch == (1,)
    c.mark_ready(1, since=0.0)
    c.mark_ready(2, since=0.0)
    assert c.decide(now=0.0, alive=3).dispatch == ()      # a third stream may still come
    assert c.decide(now=0.0, alive=2).dispatch == (1, 2)


def test_fixed_policy_always_honours_the_window() -> None:
    c = Coalescer(min_batch=4, max_wait_s=0.010, policy="fixed")
    c.mark_ready(1, since=0.0)
    d = c.decide(now=0.002, alive=1)
    assert d.dispatch == () and d.wait_s == pytest.approx(0.008)
    assert c.decide(now=0.010, alive=1).dispatch == (1,)


def test_nothing_ready_means_sleep_without_timeout() -> None:
    d = Coalescer(min_batch=2, max_wait_s=0.01).decide(now=5.0, alive=3)
    assert d.dispatch == () and d.wait_s is None


def test_max_batch_caps_oldest_first_and_keeps_the_rest() -> None:
    c = Coalescer(min_batch=2, max_wait_s=0.0, max_batch=3)
    for rid, t in ((10, 0.4), (11, 0.1), (12, 0.3), (13, 0.2)):
        c.mark_ready(rid, since=t)
    assert c.decide(now=1.0, alive=4).dispatch == (11, 13, 12)
    assert c.decide(now=1.0, alive=4).dispatch == (10,)


def test_mark_ready_keeps_the_older_arrival_and_forget_drops() -> None:
    c = Coalescer(min_batch=2, max_wait_s=0.01)
    c.mark_ready(1, since=0.0)
    c.mark_ready(1, since=0.009)
    assert c.decide(now=0.01, alive=5).dispatch == (1,)
    c.mark_ready(2, since=0.0)
    c.forget(2)
    assert c.decide(now=1.0, alive=5).dispatch == ()


@pytest.mark.parametrize("kw", [dict(min_batch=0), dict(min_batch=4, max_batch=2),
                                dict(max_wait_s=-1), dict(policy="sometimes")])
def test_rejects_bad_settings(kw: dict) -> None:
    with pytest.raises(ValueError, match="coalescing"):
        Coalescer(**kw)


def test_wait_time_does_not_consume_the_ready_set() -> None:
    c = Coalescer(min_batch=2, max_wait_s=0.01)
    assert c.wait_time(now=0.0, alive=3) is None
    c.mark_ready(1, since=0.0)
    assert c.wait_time(now=0.004, alive=3) == pytest.approx(0.006)
    assert c.wait_time(now=0.02, alive=3) == 0.0
    assert c.wait_time(now=0.02, alive=3) == 0.0   # asking twice changes nothing
    assert c.decide(now=0.02, alive=3).dispatch == (1,)


def test_a_later_due_time_lets_a_chunk_wait_past_the_window_until_something_is_due() -> None:
    c = Coalescer(min_batch=4, max_wait_s=0.010, policy="fixed")
    c.mark_ready(1, since=0.0, due=0.5)  # a chunk whose client holds audio
    assert c.decide(now=0.1, alive=8).dispatch == () and c.wait_time(0.1, alive=8) == pytest.approx(0.4)
    c.mark_ready(2, since=0.2)  # an urgent one: the default window
    assert c.decide(now=0.205, alive=8).dispatch == ()
    assert c.decide(now=0.211, alive=8).dispatch == (1, 2)  # the urgent one takes the patient one along
    c.mark_ready(3, since=1.0, due=2.0)
    for rid in (4, 5, 6):
        c.mark_ready(rid, since=1.0, due=2.0)
    assert c.decide(now=1.0, alive=8).dispatch == (3, 4, 5, 6)  # min_batch reached: no more waiting
    c.mark_ready(7, since=3.0, due=3.5)
    c.forget(7)
    assert c.wait_time(3.1, alive=8) is None
