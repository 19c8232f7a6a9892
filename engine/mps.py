"""A private CUDA MPS daemon for one engine, so talker and codec share the GPU concurrently.

Without MPS, CUDA time-slices separate processes (measured on an H200: two busy processes each ran
2.1x slower, and at full speed with MPS). When the profile asks for it (`engine.mps`) and the device is cuda, the
launcher starts `nvidia-cuda-mps-control -d` with its own pipe and log directories, hands the
workers the pipe directory (they set `CUDA_MPS_PIPE_DIRECTORY` before CUDA initialises), and on
stop sends `quit` to that daemon only, then removes its directories. Full quota: no partial SM
limits (partial quotas have been reported to give incomplete bf16 GEMM outputs).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
TIMEOUT_S = 15.0


class MpsUnavailable(RuntimeError):
    """The MPS control binary is missing or the daemon did not start."""


class MpsDaemon:
    """One private MPS control daemon: `start()`, `env` for the workers, `stop()`."""

    def __init__(self) -> None:
        self.root: str | None = None

    @property
    def pipe_dir(self) -> str:
        assert self.root is not None
        return os.path.join(self.root, "pipe")

    @property
    def log_dir(self) -> str:
        assert self.root is not None
        return os.path.join(self.root, "log")

    @property
    def env(self) -> dict[str, str]:
        """What a worker process sets before CUDA initialises. Under MPS a client's
        `CUDA_VISIBLE_DEVICES` counts the MPS server's devices (those the daemon was started with),
        not the machine's: a server run with `CUDA_VISIBLE_DEVICES=1` must give its workers `0`,
        or they find no GPU (seen on a two-GPU H200 machine)."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(visible.split(","))))
        return env

    def _run(self, args: list[str], stdin: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(args, input=stdin, env={**os.environ, **self.env},
                              capture_output=True, timeout=TIMEOUT_S, check=False)

    def start(self) -> None:
        if shutil.which(CONTROL) is None:
            raise MpsUnavailable(f"{CONTROL} not found on PATH")
        self.root = tempfile.mkdtemp(prefix="mossvox-mps-")
        os.makedirs(self.pipe_dir)
        os.makedirs(self.log_dir)
        done = self._run([CONTROL, "-d"])
        if done.returncode != 0:
            message = done.stderr.decode(errors="replace").strip()
            self._remove_dirs()
            raise MpsUnavailable(f"{CONTROL} -d failed ({done.returncode}): {message}")
        log.info("started a private MPS daemon (pipe %s)", self.pipe_dir)

    def stop(self) -> None:
        """Quit the daemon this object started (never another one); idempotent."""
        if self.root is None:
            return
        try:
            done = self._run([CONTROL], stdin=b"quit\n")
            if done.returncode != 0:
                log.warning("MPS quit returned %d: %s", done.returncode,
                            done.stderr.decode(errors="replace").strip())
        except subprocess.TimeoutExpired:
            log.warning("MPS daemon did not answer quit within %.0f s", TIMEOUT_S)
        finally:
            self._remove_dirs()

    def _remove_dirs(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


SM_SHARE_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PRIORITY_VAR = "CUDA_MPS_CLIENT_PRIORITY"
PRIORITY_LEVELS = {"normal": "0", "below_normal": "1"}  # the MPS client priority levels


def client_env(env: tuple[tuple[str, str], ...], sm_percent: int | None,
               priority: str = "normal") -> tuple[tuple[str, str], ...]:
    """A worker's environment `env` (the daemon's `env`; empty without MPS) with its share of the
    GPU's SMs (`talker.sm_percent`, `codec.sm_percent`) when a share is set, and its MPS client
    priority (`talker.mps_priority`, `codec.mps_priority`) when below normal: the MPS server
    then schedules the other stage's ready work first. Nothing is added without MPS."""
    if not env:
        return env
    extra: list[tuple[str, str]] = []
    if sm_percent is not None:
        extra.append((SM_SHARE_VAR, str(sm_percent)))
    if priority != "normal":
        extra.append((PRIORITY_VAR, PRIORITY_LEVELS[priority]))
    return (*env, *extra)


def maybe_start(wanted: bool, device: str) -> MpsDaemon | None:
    """A started daemon when the profile wants MPS on cuda; None (logged) when it cannot start."""
    if not wanted or not device.startswith("cuda"):
        return None
    daemon = MpsDaemon()
    try:
        daemon.start()
    except (MpsUnavailable, OSError, subprocess.TimeoutExpired) as exc:
        log.warning("engine.mps is on but MPS is unavailable (%s): talker and codec will "
                    "time-slice the GPU", exc)
        return None
    return daemon
