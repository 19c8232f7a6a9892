"""Every shipped checkpoint family served by the engine on CPU the way the `default` profile serves
it: lengths not forced from the text (`model.force_length_from_text` off), so random weights
sample freely, stop where they stop, or run to `model.max_new_frames`. Each family's requests, over
several seeds, end normally with decodable audio: no request fails in a worker (a code the codec
cannot decode was one such failure)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.launcher import launch
from profiles import load_profile
from speech.job import SpeechJob
from stages.tools.make_checkpoint import checkpoint_recipes, make_checkpoint
from tests.engine.conftest import collect, settle

TEXTS = {"ttsd": "[S1] Hello there. [S2] Hi, how are you?"}
INSTRUCTIONS = {"voice-generator": "a calm, low voice"}
SEEDS = (1, 2, 3, 4, 5)


@pytest.mark.parametrize("family", sorted(checkpoint_recipes()))
async def test_a_family_serves_without_forced_lengths(tmp_path, family) -> None:
    make_checkpoint(tmp_path / family, variant=family, size="tiny", seed=4)
    profile = load_profile("cpu", ["model.force_length_from_text=false", "model.max_new_frames=24"])
    handle = await launch(profile, tmp_path / family)
    client = handle.client(0)
    try:
        jobs = [SpeechJob(text=TEXTS.get(family, "Hello from a random checkpoint."),
                          instructions=INSTRUCTIONS.get(family), sampling={"seed": seed})
                for seed in SEEDS]
        results = await asyncio.wait_for(asyncio.gather(*(collect(client, job) for job in jobs)), 300)
        for chunks in results:
            assert chunks[-1].final and chunks[-1].finish_reason in ("stop", "length")
            pcm = np.concatenate([c.pcm for c in chunks])
            assert np.isfinite(pcm).all()
        snap = await settle(client)
        assert snap["failed"] == 0 and snap["running"] == 0 and snap["codec_slots"] == 0
    finally:
        await asyncio.wait_for(handle.stop(), 30)
