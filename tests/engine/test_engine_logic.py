"""Pure coordinator logic: admission verdicts and retry hints, the request table, the lifecycle."""

import asyncio

import numpy as np
import pytest

from engine.admission import Admission, Verdict
from engine.request_table import Phase, Request, RequestTable
from engine.shutdown import EngineState, Lifecycle
from ipc.messages import Submit
from speech.sampling import SamplingParams

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
                          text_temperature=1.0, text_top_p=1.0, text_top_k=0, greedy=True, seed=0,
                          max_new_frames=10)


def req(rid: int) -> Request:
    return Request(submit=Submit(rid=rid, client=0, sampling=SAMPLING),
                   prompt=np.zeros((3, 4), np.int64), t_submit=0.0)


def test_admission_runs_then_queues_then_rejects() -> None:
    adm = Admission(max_running=2, max_queued=3)
    assert adm.decide(num_running=1, num_queued=0) is Verdict.RUN
    assert adm.decide(num_running=2, num_queued=0) is Verdict.QUEUE
    # a newcomer never overtakes the queue even when a slot is free
    assert adm.decide(num_running=1, num_queued=1) is Verdict.QUEUE
    assert adm.decide(num_running=2, num_queued=3) is Verdict.REJECT


def test_retry_after_follows_service_time_and_queue_depth() -> None:
    adm = Admission(max_running=4, max_queued=8, default_retry_after_s=2.5)
    assert adm.retry_after_s(8) == 2.5
    adm.record_service_time(2.0)
    assert adm.retry_after_s(7) == pytest.approx(2.0 * 8 / 4)
    adm.record_service_time(4.0)   # EMA moves towards the new sample
    assert 2.0 < adm.retry_after_s(3) < 4.0


def test_request_table_moves_and_counts() -> None:
    table = RequestTable()
    for rid in (1, 2, 3):
        table.enqueue(req(rid))
    assert (table.num_queued, table.num_running) == (3, 0)
    head = table.next_queued()
    assert head is not None and head.rid == 1
    table.start(head, now=1.0)
    assert head.phase is Phase.RUNNING and head.prompt is None and head.t_dispatch == 1.0
    assert (table.num_queued, table.num_running) == (2, 1)
    with pytest.raises(KeyError):
        table.enqueue(req(2))
    assert table.remove(2) is not None and table.remove(2) is None
    assert table.remove(1) is head
    assert len(table) == 1 and 3 in table and 1 not in table


def test_remove_cancels_deadline() -> None:
    loop = asyncio.new_event_loop()
    try:
        fired: list[int] = []
        r = req(9)
        r.deadline = loop.call_later(0.0, fired.append, 9)
        table = RequestTable()
        table.enqueue(r)
        table.remove(9)
        loop.run_until_complete(asyncio.sleep(0.01))
        assert fired == [] and r.deadline is None
    finally:
        loop.close()


async def test_lifecycle_running_draining_stopped() -> None:
    life = Lifecycle("drain")
    assert life.accepting and life.healthy
    waiter = asyncio.create_task(life.wait_for(EngineState.STOPPED))
    life.request_stop()
    life.request_stop()  # idempotent
    assert life.state is EngineState.DRAINING and not life.accepting and life.healthy
    await asyncio.sleep(0)
    assert not waiter.done()
    life.finish()
    assert await asyncio.wait_for(waiter, 1) is EngineState.STOPPED


async def test_lifecycle_failure_is_unhealthy_and_final() -> None:
    life = Lifecycle("abort")
    life.fail("talker died")
    assert not life.healthy and life.reason == "talker died"
    life.fail("codec died")        # the first reason stays
    assert life.reason == "talker died"
    life.finish()
    assert life.state is EngineState.STOPPED
    with pytest.raises(RuntimeError, match="not allowed"):
        life._move(EngineState.RUNNING)


def test_fit_kv_cache_cuts_the_frame_budget_or_refuses():
    """One request must fit a talker's whole KV cache alone: its frame budget is cut to the rows
    its prompt leaves; a prompt that leaves no room for its forced frames (or one frame) is a
    ValueError naming the limit."""
    from engine.client import fit_kv_cache
    from stages.variant import TalkerRequest

    prompt = np.zeros((100, 4), dtype=np.int64)
    roomy = TalkerRequest(prompt, SamplingParams(max_new_frames=50))
    assert fit_kv_cache(roomy, 150) is roomy
    cut = fit_kv_cache(TalkerRequest(prompt, SamplingParams(max_new_frames=4096, seed=3)), 150)
    assert cut.sampling.max_new_frames == 50 and cut.sampling.seed == 3 and cut.prompt is prompt
    assert fit_kv_cache(TalkerRequest(prompt, SamplingParams(forced_frames=50)), 150).sampling.forced_frames == 50
    with pytest.raises(ValueError, match="followed by 51 frames.*at most 150 rows"):
        fit_kv_cache(TalkerRequest(prompt, SamplingParams(forced_frames=51)), 150)
    with pytest.raises(ValueError, match="prompt of 100 rows, and the talker's KV cache holds at most 100 rows"):
        fit_kv_cache(TalkerRequest(prompt, SamplingParams()), 100)
