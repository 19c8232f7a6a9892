"""The engine with a tensor-parallel Delay talker on CPU (gloo): `talker.tensor_parallel: 2`.

Real processes all the way: the talker worker (a daemonic multiprocessing child) becomes rank 0
and starts its follower rank; a request's audio equals direct in-process synthesis at TP=1; after
stop the follower is gone too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from engine.launcher import launch
from profiles import load_profile
from speech.job import SpeechJob
from stages.runtime.tensor_parallel import MULTICAST_OFF
from stages.tools.make_checkpoint import make_checkpoint
from tests.engine.conftest import collect, joined

pytestmark = pytest.mark.asyncio(loop_scope="module")

OVERRIDES = ["talker.max_running=2", "talker.kv_blocks=64", "admission.max_running=2"]
TEXT = "split over two ranks"


@pytest.fixture(scope="module")
def delay_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("delay_tp")
    make_checkpoint(out, variant="delay", size="tiny", seed=3)
    return out


def follower_pids(parent: int) -> list[int]:
    """Running `stages.workers.tp_ranks` processes whose parent is `parent`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if b"stages.workers.tp_ranks" in cmdline and int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def environment(pid: int) -> dict[str, str]:
    raw = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(delay_dir):
    """(audio, follower pids while serving, their environments, those still alive after stop) at TP=2."""
    handle = await launch(load_profile("cpu", [*OVERRIDES, "talker.tensor_parallel=2"]), delay_dir, clients=1)
    try:
        talker = handle.pids["talker"]
        running = follower_pids(talker)
        environ = [environment(pid) for pid in running]
        audio = joined(await collect(handle.client(0), SpeechJob(text=TEXT, sampling={"seed": 9})))
    finally:
        await handle.stop()
    return audio, running, environ, [pid for pid in running if alive(pid)]  # an orphan would have a new parent


async def test_tp2_engine_audio_equals_direct_tp1(served, delay_dir) -> None:
    from stages.synth_direct import DirectSynthesizer

    audio, *_ = served
    direct = DirectSynthesizer(delay_dir, load_profile("cpu", OVERRIDES))
    expected, stats = direct.synthesize(TEXT, seed=9)
    assert audio.shape == expected.T.shape and stats.frames > 0
    np.testing.assert_allclose(audio, expected.T, atol=1e-4, rtol=0)
    assert np.abs(audio).max() > 0


async def test_the_follower_rank_runs_with_multicast_off_and_stops_with_the_engine(served) -> None:
    _, running, environ, after = served
    assert len(running) == 1
    assert all(env.get(k) == v for env in environ for k, v in MULTICAST_OFF.items())  # NVLink multicast off
    assert after == []
