"""Driving a talker runner through staggered arrivals, for tests that compare two runners' frames."""

from __future__ import annotations

import numpy as np


def drive(runner, arrivals: dict[int, list], max_steps: int = 400) -> dict[int, np.ndarray]:
    """Add each (rid, prompt, params) of `arrivals[step]` before that step, step until every
    request has finished (or `max_steps`); returns every request's frames [F, n_vq]."""
    out = {rid: [] for items in arrivals.values() for rid, _, _ in items}
    for step in range(max_steps):
        for rid, prompt, params in arrivals.get(step, []):
            runner.add(rid, prompt, params)
        for e in runner.step():
            if e.codes is not None:
                out[e.rid].append(e.codes)
        if runner.num_running() == 0 and step >= max(arrivals):
            break
    return {rid: np.stack(v) for rid, v in out.items()}
