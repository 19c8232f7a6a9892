"""Shared helpers for the engine tests: the tiny demo checkpoint, settling counters."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from engine.counters import LEAK_GAUGES


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """The tiny random-weight Local-v1.5 demo checkpoint (written once per session)."""
    from stages.tools.demo_model import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo-cache"))


async def settle(client, timeout: float = 10.0) -> dict:
    """Wait until every leak gauge reads zero (records still in flight land); last snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        snap = client.counters()
        if all(snap[g] == 0 for g in LEAK_GAUGES) and snap["client_ring_bytes"] == 0:
            return snap
        if time.monotonic() > deadline:
            return snap
        await asyncio.sleep(0.02)


async def collect(client, job) -> list:
    """All chunks of one request."""
    return [chunk async for chunk in client.generate(job)]


def joined(chunks) -> np.ndarray:
    return np.concatenate([c.pcm for c in chunks])
