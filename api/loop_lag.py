"""How late an API process's event loop runs its timers: the wait any request's work had there.

`watch_loop_lag` sleeps `period_s` over and over and reports each oversleep. A loop kept busy
(HTTP parsing, PCM conversion, routing engine records for every stream the process serves) runs a
timer late by as long as the callbacks ahead of it took, and a request arriving then, or a chunk
to send, waits as long: a server's first audio at high concurrency carries that wait, which no
engine timeline sees. `/metrics` exports it as ``mossvox_api_loop_lag_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

LAG_PERIOD_S = 0.02  # one timer every 20 ms: a few hundred callbacks a minute, none of them costly


async def watch_loop_lag(observe: Callable[[float], None], period_s: float = LAG_PERIOD_S) -> None:
    """Report, every `period_s`, how much later than asked the loop resumed a sleep (seconds)."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + period_s
        await asyncio.sleep(period_s)
        observe(max(0.0, loop.time() - asked))


@contextlib.asynccontextmanager
async def loop_lag_watched(observe: Callable[[float], None],
                           period_s: float = LAG_PERIOD_S) -> AsyncIterator[None]:
    """`watch_loop_lag` as a task for the body of the block, cancelled when it ends."""
    task = asyncio.create_task(watch_loop_lag(observe, period_s), name="loop-lag")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
