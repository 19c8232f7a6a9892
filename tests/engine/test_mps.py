"""The private MPS daemon (GPU machines only): started with its own directories, workers get its
pipe, and stop quits that daemon and removes them. The engine runs with it end to end."""

from __future__ import annotations

import os
import shutil

import pytest

from engine.mps import CONTROL, PRIORITY_VAR, SM_SHARE_VAR, MpsDaemon, client_env, maybe_start

needs_mps = pytest.mark.skipif(
    shutil.which(CONTROL) is None or not os.path.exists("/dev/nvidiactl"),
    reason=f"needs a CUDA machine with {CONTROL}")


def test_not_started_without_cuda_or_when_off() -> None:
    assert maybe_start(True, "cpu") is None
    assert maybe_start(False, "cuda") is None


@pytest.mark.gpu
@needs_mps
def test_private_daemon_starts_and_stops() -> None:
    daemon = MpsDaemon()
    daemon.start()
    root = daemon.root
    try:
        assert os.path.isdir(daemon.pipe_dir)
        assert daemon.env["CUDA_MPS_PIPE_DIRECTORY"] == daemon.pipe_dir
    finally:
        daemon.stop()
    assert root is not None and not os.path.exists(root)


@pytest.mark.gpu
@needs_mps
@pytest.mark.parametrize("extra", [[], ["codec.mps_priority=below_normal"]])
async def test_engine_on_cuda_with_mps(demo_model_dir, extra) -> None:
    """A request end to end with both workers MPS clients, the codec's at below-normal priority too."""
    from engine.launcher import launch
    from profiles import load_profile
    from speech.job import SpeechJob
    from tests.engine.conftest import collect

    handle = await launch(load_profile("cpu", ["model.device=cuda", "engine.mps=true", *extra]),
                          demo_model_dir)
    try:
        assert handle.mps is not None
        chunks = await collect(handle.client(0), SpeechJob(text="gpu", forced_frames=20,
                                                           sampling={"seed": 1}))
        assert chunks[-1].finish_reason == "stop"
    finally:
        await handle.stop()
    assert handle.mps.root is None


def test_workers_count_devices_as_the_mps_server_sees_them(monkeypatch, tmp_path) -> None:
    """Under MPS a client's CUDA_VISIBLE_DEVICES indexes the daemon's devices: a server started
    with CUDA_VISIBLE_DEVICES=1 (or 2,3) hands its workers 0 (or 0,1)."""
    daemon = MpsDaemon()
    daemon.root = str(tmp_path)  # as after start(); nothing is run
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in daemon.env
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert daemon.env["CUDA_VISIBLE_DEVICES"] == "0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert daemon.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_a_stage_gets_its_sm_share_only_under_mps(tmp_path) -> None:
    """`talker.sm_percent` / `codec.sm_percent` reach a worker as the MPS client's active-thread
    percentage, and only when the daemon runs (without MPS the variable means nothing)."""
    from profiles import load_profile

    daemon = MpsDaemon()
    daemon.root = str(tmp_path)
    env = tuple(daemon.env.items())
    profile = load_profile("high-concurrency", ["codec.sm_percent=40"])
    assert (profile.talker.sm_percent, profile.codec.sm_percent) == (None, 40)
    assert client_env(env, profile.talker.sm_percent) == env
    assert dict(client_env(env, profile.codec.sm_percent)) == {**daemon.env, SM_SHARE_VAR: "40"}
    assert client_env((), profile.codec.sm_percent) == ()  # no daemon: nothing to set
    from profiles import ProfileError
    for bad in ("0", "101"):
        with pytest.raises(ProfileError, match="sm_percent"):
            load_profile("high-concurrency", [f"talker.sm_percent={bad}"])


def test_a_stage_below_normal_priority_reaches_its_worker_only_under_mps(tmp_path) -> None:
    """`codec.mps_priority: below_normal` reaches the codec worker as the MPS client priority 1,
    beside its SM share when both are set; the talker at normal priority gets nothing extra; and
    without the daemon nothing is set. An unknown level is a profile error."""
    from profiles import ProfileError, load_profile

    daemon = MpsDaemon()
    daemon.root = str(tmp_path)
    env = tuple(daemon.env.items())
    profile = load_profile("high-concurrency", ["codec.mps_priority=below_normal", "codec.sm_percent=80"])
    assert (profile.talker.mps_priority, profile.codec.mps_priority) == ("normal", "below_normal")
    assert client_env(env, profile.talker.sm_percent, profile.talker.mps_priority) == env
    assert dict(client_env(env, profile.codec.sm_percent, profile.codec.mps_priority)) == {
        **daemon.env, SM_SHARE_VAR: "80", PRIORITY_VAR: "1"}
    assert client_env((), profile.codec.sm_percent, profile.codec.mps_priority) == ()
    with pytest.raises(ProfileError, match="mps_priority"):
        load_profile("high-concurrency", ["codec.mps_priority=lowest"])
