"""Admission by buffered audio: the gate's bookkeeping, then the engine holding a newcomer back."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio

from engine.admission import Admission, Verdict
from engine.launcher import launch
from engine.playout_gate import PlayoutGate
from profiles import load_profile
from speech.job import SpeechJob
from tests.engine.conftest import settle


def test_gate_holds_while_a_counted_stream_runs_low() -> None:
    gate = PlayoutGate(min_lead_s=0.5, settle_s=1.0)
    gate.on_audio(1, t_first=10.0, audio_s=0.4)  # still in its first chunks: not counted
    assert len(gate) == 0 and not gate.holding(now=10.3)
    gate.on_audio(1, t_first=10.0, audio_s=1.2)  # plays until 11.2
    assert gate.lowest_lead_s(now=10.5) == pytest.approx(0.7) and not gate.holding(now=10.5)
    assert gate.holding(now=10.8)                # 0.4 s left
    gate.on_audio(2, t_first=10.5, audio_s=3.0)  # far ahead: the lowest is still stream 1
    assert gate.holding(now=10.8)
    gate.on_audio(1, t_first=10.0, audio_s=2.0)  # a chunk lifts stream 1 (runs out at 12.0)
    assert not gate.holding(now=10.8) and gate.lowest_lead_s(now=10.8) == pytest.approx(1.2)
    gate.forget(1)                               # ended: stream 2 (13.5) is the lowest now
    assert gate.lowest_lead_s(now=10.8) == pytest.approx(2.7)
    assert gate.holding(now=13.2)                # stream 2 runs low in its turn
    gate.forget(2)
    assert gate.lowest_lead_s(now=13.2) is None and not gate.holding(now=13.2)


def test_gate_off_never_holds_and_keeps_nothing() -> None:
    gate = PlayoutGate(min_lead_s=0.0, settle_s=0.0)
    gate.on_audio(1, t_first=0.0, audio_s=0.1)
    assert not gate.enabled and len(gate) == 0 and not gate.holding(now=100.0)


def test_gate_keeps_its_heap_small_over_many_chunks() -> None:
    gate = PlayoutGate(min_lead_s=0.5, settle_s=0.0)
    for chunk in range(1, 2001):
        for rid in range(4):
            gate.on_audio(rid, t_first=0.0, audio_s=0.08 * chunk)
    assert len(gate) == 4 and len(gate._heap) <= 4 * 4 + 64 + 1
    assert gate.lowest_lead_s(now=0.0) == pytest.approx(160.0)


def test_admission_queues_and_holds_dispatch_while_held() -> None:
    adm = Admission(max_running=4, max_queued=2)
    assert adm.decide(num_running=0, num_queued=0, hold=True) is Verdict.QUEUE
    assert adm.decide(num_running=0, num_queued=2, hold=True) is Verdict.REJECT
    assert not adm.may_dispatch(0, hold=True) and adm.may_dispatch(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gated(demo_model_dir):
    """A CPU engine whose gate counts every stream from its first chunk and wants a minute of
    audio ahead: while one stream plays, every newcomer waits."""
    handle = await launch(load_profile("cpu", ["admission.min_lead_s=60", "admission.lead_settle_s=0"]),
                          demo_model_dir, clients=1)
    try:
        yield handle
    finally:
        await handle.stop()


async def _timed(client, job, log: list) -> None:
    async for chunk in client.generate(job):
        log.append((time.monotonic(), chunk))


@pytest.mark.asyncio(loop_scope="module")
async def test_a_newcomer_waits_until_the_playing_stream_is_served(gated) -> None:
    client = gated.client(0)
    first, second = [], []
    a = asyncio.create_task(_timed(client, SpeechJob(text="a", forced_frames=40, sampling={"seed": 1}),
                                   first))
    while not first or client.counters()["chunks"] < 1:  # the coordinator has seen it play too
        await asyncio.sleep(0.002)
    b = asyncio.create_task(_timed(client, SpeechJob(text="b", forced_frames=4, sampling={"seed": 2}),
                                   second))
    held = None
    while not a.done() and held is None:
        snap = client.counters()
        if snap["queued"] == 1:
            held = snap
        await asyncio.sleep(0.002)
    await asyncio.gather(a, b)
    assert first[-1][1].final and second[-1][1].final
    # with 8 places free, only the gate kept the second request from starting beside the first
    assert second[0][0] > first[-1][0], "the second request started while the first still played"
    if held is not None:  # seen while it waited (a fast first request may end before a poll)
        assert held["admission_held"] == 1 and held["running"] == 1
    snap = await settle(client)
    assert snap["admission_holds"] >= 1 and snap["admission_held"] == 0 and snap["queued"] == 0
