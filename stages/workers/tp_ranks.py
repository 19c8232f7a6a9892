"""Starting and stopping the follower ranks of a tensor-parallel talker (process shells only).

The talker worker process is rank 0. `start_followers` starts ranks 1..n-1 as child processes
(`python -m stages.workers.tp_ranks SPEC RANK`): plain subprocesses, because the engine's talker
worker is a daemonic multiprocessing child, which multiprocessing forbids to have children of its
own. Each child gets the NVLink-multicast-off variables in its environment, dies with its parent
(`PR_SET_PDEATHSIG`), joins the group at a loopback port chosen at start, and runs the family's
follower (`TPSpec.follower`, "module:function": builds its shard and follows rank 0) until rank 0
closes. `FollowerRanks.stop()` then waits for every child (killing one that hangs).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from stages.runtime.tensor_parallel import MULTICAST_OFF, TPGroup, destroy_tp, free_port, init_tp
from stages.workers.common import attention_without_plans, die_with_parent

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TPSpec:
    """What every rank needs to join the group and build its part of the talker (JSON on argv)."""

    follower: str  # "module:function", called as function(spec, rank, tp) -> steps run, on ranks 1..n-1
    model_dir: str
    address: str  # tcp://127.0.0.1:PORT
    devices: tuple[str, ...]  # the device of each rank; len = TP size
    dtype: str  # torch dtype name: float32, bfloat16
    parent_pid: int
    torch_threads: int | None = None
    attention: str = "auto"  # `stages.runtime.attention.backends.make_attention` name, the same on every rank
    options: dict = field(default_factory=dict)  # the family's runner keywords every rank shares

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def tp_devices(device: str, size: int) -> list[str]:
    """The device of each of `size` ranks: `cuda` / `cuda:i` -> consecutive GPUs from i; `cpu` -> cpu each."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return [str(dev)] * size
    first = dev.index or 0
    return [f"cuda:{first + r}" for r in range(size)]


def new_spec(follower: str, model_dir: str | Path, devices: list[str], dtype: torch.dtype, *,
             torch_threads: int | None = None, attention: str = "auto", **options) -> TPSpec:
    """A spec for a group over `devices` (this process is rank 0) at a free loopback port."""
    return TPSpec(follower, str(Path(model_dir).resolve()), f"tcp://127.0.0.1:{free_port()}", tuple(devices),
                  str(dtype).removeprefix("torch."), os.getpid(), torch_threads, attention, options)


class FollowerRanks:
    """The child processes of ranks 1..n-1."""

    def __init__(self, spec: TPSpec) -> None:
        env = {**os.environ, **MULTICAST_OFF}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO_ROOT), env.get("PYTHONPATH"))))
        payload = json.dumps(asdict(spec))
        self.processes = [subprocess.Popen([sys.executable, "-m", "stages.workers.tp_ranks", payload, str(rank)],
                                           env=env)
                          for rank in range(1, spec.size)]

    def gone(self) -> list[str]:
        """The followers that have exited, "rank R (pid P, exit code C)" each (a poll, no wait)."""
        return [f"rank {rank} (pid {proc.pid}, exit code {proc.returncode})"
                for rank, proc in enumerate(self.processes, start=1) if proc.poll() is not None]

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> list[int]:
        """Wait for every child (kill one still running after `timeout`); their exit codes."""
        codes = []
        for proc in self.processes:
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank (pid %d) did not stop: killing it", proc.pid)
                proc.kill()
                codes.append(proc.wait())
        return codes

    def kill(self) -> None:
        """Kill every child and reap it (start-up failed on rank 0)."""
        for proc in self.processes:
            proc.kill()
        self.stop()


def start_followers(spec: TPSpec) -> tuple[FollowerRanks, TPGroup]:
    """Start ranks 1..n-1 and join the group as rank 0; on failure kill them and leave."""
    ranks = FollowerRanks(spec)
    try:
        return ranks, init_tp(spec.size, 0, spec.address, spec.devices[0])
    except BaseException:
        ranks.kill()
        destroy_tp()
        raise


def follower_main(spec: TPSpec, rank: int) -> int:
    """One follower rank, start to finish; returns the steps it ran."""
    os.environ.update(MULTICAST_OFF)
    die_with_parent(spec.parent_pid)
    if spec.torch_threads is not None:
        torch.set_num_threads(spec.torch_threads)
    attention_without_plans()  # the leader's kernels, step for step
    module, function = spec.follower.split(":")
    follow = getattr(importlib.import_module(module), function)
    tp = init_tp(spec.size, rank, spec.address, spec.devices[rank])
    try:
        return follow(spec, rank, tp)
    finally:
        destroy_tp()


if __name__ == "__main__":
    raw = json.loads(sys.argv[1])
    raw["devices"] = tuple(raw["devices"])
    follower_main(TPSpec(**raw), int(sys.argv[2]))
    # The group is destroyed; skip interpreter finalization, where gloo's worker threads can still
    # abort the process (SIGABRT, "terminate called without an active exception"; pytorch#190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
