"""Non-blocking sends from asyncio code: `Outbox.put` never awaits and never blocks the loop.

A record goes straight into the channel's ring when there is room. When the ring is full (the
peer is slow) the record — payload copied — waits in a backlog, in order, and a flush task
sleeps on the ring's space doorbell (via `loop.add_reader`) until the peer makes room. Blocking
instead would deadlock an in-process client and its coordinator, which share one loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import numpy as np

from ipc.channel import Channel
from ipc.errors import IpcError, WouldBlock

log = logging.getLogger(__name__)


class Outbox:
    """Ordered, never-blocking sender over one channel's writing end."""

    def __init__(self, channel: Channel, name: str) -> None:
        self.channel = channel
        self.name = name
        self._backlog: deque[tuple[Any, np.ndarray | None]] = deque()
        self._flusher: asyncio.Task | None = None
        self.broken: BaseException | None = None  # the peer is gone: puts are dropped

    @property
    def backlog(self) -> int:
        return len(self._backlog)

    def put(self, msg: Any, payload: Any = None) -> bool:
        """Send `msg` (+ payload) now or after the backlog; False if the peer is gone."""
        if self.broken is not None:
            return False
        if not self._backlog:
            try:
                self.channel.send(msg, payload, block=False)
                return True
            except WouldBlock:
                pass
            except IpcError as exc:
                self._break(exc)
                return False
        owned = None if payload is None else np.array(payload, copy=True)
        self._backlog.append((msg, owned))
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return True

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._backlog:
                msg, payload = self._backlog[0]
                try:
                    self.channel.send(msg, payload, block=False)
                    self._backlog.popleft()
                    continue
                except WouldBlock:
                    pass
                woke: asyncio.Future[int] = loop.create_future()
                fds = self.channel.wait_fds()  # the space doorbell and the peer's pidfd
                for fd in fds:
                    loop.add_reader(fd, lambda fd=fd: woke.done() or woke.set_result(fd))
                try:
                    fired = await woke
                finally:
                    for fd in fds:
                        loop.remove_reader(fd)
                self.channel.on_wake(fired)  # drains the bell, or notes the peer's death
        except IpcError as exc:
            self._break(exc)
        finally:
            self._flusher = None

    def _break(self, exc: BaseException) -> None:
        log.warning("outbox %s: peer gone (%s); dropping %d queued records", self.name, exc,
                    len(self._backlog))
        self.broken = exc
        self._backlog.clear()

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            self._flusher = None
        self._backlog.clear()
