"""The API processes' event-loop lag: a blocked loop is reported by how long it was blocked, an
idle one by about nothing, and the watcher stops with its block (a served `/metrics` exporting it:
`tests/api/test_speech_e2e.py`)."""

from __future__ import annotations

import asyncio
import time

from api.loop_lag import loop_lag_watched


async def test_a_blocked_loop_is_reported_by_how_long_it_was_blocked():
    seen: list[float] = []
    async with loop_lag_watched(seen.append, period_s=0.01):
        await asyncio.sleep(0.05)  # idle: the timers run on time
        idle = len(seen)
        time.sleep(0.12)  # every callback waits behind this
        await asyncio.sleep(0.03)
    assert idle >= 2 and max(seen[:idle]) < 0.05
    assert max(seen[idle:]) >= 0.1
    count = len(seen)
    await asyncio.sleep(0.05)
    assert len(seen) == count  # cancelled with its block

