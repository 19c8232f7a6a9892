"""The coordinator's request table: every request from submission until its codec stream closes."""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ipc.messages import Submit


class Phase(enum.Enum):
    QUEUED = "queued"      # admitted to the waiting queue; holds its prompt
    RUNNING = "running"    # sent to the talker; ends when the codec reports its final chunk
    ABORTING = "aborting"  # abort sent to both workers; ends the same way


@dataclass(slots=True)
class Request:
    """One request's coordinator-side state."""

    submit: Submit
    prompt: np.ndarray | None       # [S, 1 + n_vq] int64; an owned copy while queued, else None
    t_submit: float
    phase: Phase = Phase.QUEUED
    t_dispatch: float | None = None
    t_first_chunk: float | None = None
    chunks: int = 0
    samples: int = 0
    replica: int = -1               # the replica it was dispatched to (-1: not yet)
    input_open: bool = False        # submitted with open_input and no final Feed yet
    deadline: asyncio.TimerHandle | None = field(default=None, repr=False)
    feeds: list = field(default_factory=list, repr=False)  # (Feed, rows) held while queued

    @property
    def rid(self) -> int:
        return self.submit.rid

    @property
    def client(self) -> int:
        return self.submit.client


class RequestTable:
    """Queued requests in arrival order, dispatched ones by id. No I/O."""

    def __init__(self) -> None:
        self._queued: OrderedDict[int, Request] = OrderedDict()
        self._active: dict[int, Request] = {}  # RUNNING or ABORTING

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_running(self) -> int:
        return len(self._active)

    def __len__(self) -> int:
        return len(self._queued) + len(self._active)

    def __contains__(self, rid: int) -> bool:
        return rid in self._queued or rid in self._active

    def get(self, rid: int) -> Request | None:
        return self._queued.get(rid) or self._active.get(rid)

    def enqueue(self, req: Request) -> None:
        if req.rid in self:
            raise KeyError(f"request {req.rid} is already in the table")
        req.phase = Phase.QUEUED
        self._queued[req.rid] = req

    def start(self, req: Request, now: float) -> None:
        """Mark `req` (new or the head of the queue) as dispatched to the workers."""
        self._queued.pop(req.rid, None)
        if req.rid in self._active:
            raise KeyError(f"request {req.rid} is already running")
        req.phase, req.t_dispatch, req.prompt = Phase.RUNNING, now, None
        self._active[req.rid] = req

    def next_queued(self) -> Request | None:
        """The oldest queued request (still queued; `start` moves it)."""
        return next(iter(self._queued.values()), None)

    def remove(self, rid: int) -> Request | None:
        """Drop `rid` from the table and cancel its deadline; None when unknown."""
        req = self._queued.pop(rid, None) or self._active.pop(rid, None)
        if req is not None and req.deadline is not None:
            req.deadline.cancel()
            req.deadline = None
        return req

    def active(self) -> list[Request]:
        return list(self._active.values())

    def all(self) -> list[Request]:
        return [*self._queued.values(), *self._active.values()]
