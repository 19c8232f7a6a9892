"""Starting and stopping the ranks of a tensor-parallel Delay talker.

The talker worker process is rank 0. `start_delay_tp` starts ranks 1..n-1 as child processes
(`python -m stages.workers.tp_ranks SPEC RANK`): plain subprocesses, because the engine's talker worker is
a daemonic multiprocessing child, which multiprocessing forbids to have children of its own. Each
child gets the NVLink-multicast-off variables in its environment, dies with its parent
(`PR_SET_PDEATHSIG`), joins the group at a loopback port chosen at start, loads its shard and
follows rank 0 (`stages.models.delay.tp_runner.follow`) until the runner closes. `TPDelayRunner.close()`
then waits for every child (killing one that hangs) and leaves the group.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from stages.runtime.attention.backends import make_attention
from stages.models.delay.model import DelayModel
from stages.models.delay.tp_runner import TPDelayRunner, follow
from stages.runtime.tensor_parallel import MULTICAST_OFF, destroy_tp, free_port, init_tp

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class TPSpec:
    """What every rank needs to join the group and build its part of the talker (JSON on argv)."""

    model_dir: str
    address: str  # tcp://127.0.0.1:PORT
    devices: tuple[str, ...]  # the device of each rank; len = TP size
    dtype: str  # torch dtype name: float32, bfloat16
    parent_pid: int
    max_running: int = 64
    kv_block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_fraction: float = 0.5
    torch_threads: int | None = None
    attention: str = "auto"  # `stages.runtime.attention.backends.make_attention` name, the same on every rank

    @property
    def size(self) -> int:
        return len(self.devices)

    def kv_options(self) -> dict:
        return {"max_running": self.max_running, "kv_block_size": self.kv_block_size,
                "num_kv_blocks": self.num_kv_blocks, "kv_memory_fraction": self.kv_memory_fraction}


class FollowerRanks:
    """The child processes of ranks 1..n-1."""

    def __init__(self, spec: TPSpec) -> None:
        env = {**os.environ, **MULTICAST_OFF}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO_ROOT), env.get("PYTHONPATH"))))
        payload = json.dumps(asdict(spec))
        self.processes = [subprocess.Popen([sys.executable, "-m", "stages.workers.tp_ranks", payload, str(rank)], env=env)
                          for rank in range(1, spec.size)]

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


class LaunchedTPDelayRunner(TPDelayRunner):
    """Rank 0 of a group `start_delay_tp` started: `close()` also reaps the followers and leaves."""

    def __init__(self, model: DelayModel, tp, ranks: FollowerRanks, **options) -> None:
        super().__init__(model, tp, **options)
        self.ranks = ranks
        self.exit_codes: list[int] | None = None

    def close(self) -> None:
        if self.exit_codes is not None:
            return
        try:
            super().close()
        except RuntimeError as exc:  # a follower is already gone (gloo: connection closed by peer)
            log.warning("tensor-parallel ranks could not be told to stop: %s", exc)
        finally:
            self.exit_codes = self.ranks.stop()
            destroy_tp()


def tp_devices(device: str, size: int) -> list[str]:
    """The device of each of `size` ranks: `cuda` / `cuda:i` -> consecutive GPUs from i; `cpu` -> cpu each."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return [str(dev)] * size
    first = dev.index or 0
    return [f"cuda:{first + r}" for r in range(size)]


def start_delay_tp(model_dir: str | Path, *, devices: list[str], dtype: torch.dtype = torch.float32,
                   max_running: int = 64, kv_block_size: int = 16, num_kv_blocks: int | None = None,
                   kv_memory_fraction: float = 0.5, torch_threads: int | None = None, attention: str = "auto",
                   **runner_options) -> LaunchedTPDelayRunner:
    """Rank 0's runner of a Delay talker split over `devices` (one rank each; this process is rank 0).

    attention: the backend every rank uses (`make_attention` name); runner_options: the other
    `DelayRunner` options (prefill sizes, finish rule). Steps run eagerly (no graphs under TP).
    """
    spec = TPSpec(str(Path(model_dir).resolve()), f"tcp://127.0.0.1:{free_port()}", tuple(devices),
                  str(dtype).removeprefix("torch."), os.getpid(), max_running, kv_block_size, num_kv_blocks,
                  kv_memory_fraction, torch_threads, attention)
    ranks = FollowerRanks(spec)
    try:
        tp = init_tp(spec.size, 0, spec.address, devices[0])
        model = DelayModel.from_dir(model_dir, device=devices[0], dtype=dtype, tp=tp)
        return LaunchedTPDelayRunner(model, tp, ranks, attention=make_attention(attention, devices[0]),
                                     **spec.kv_options(), **runner_options)
    except BaseException:
        for proc in ranks.processes:
            proc.kill()
        ranks.stop()
        destroy_tp()
        raise


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: rank 0's close() still reaps us
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def follower_main(spec: TPSpec, rank: int) -> int:
    """One follower rank, start to finish; returns the steps it ran."""
    os.environ.update(MULTICAST_OFF)
    _die_with_parent(spec.parent_pid)
    if spec.torch_threads is not None:
        torch.set_num_threads(spec.torch_threads)
    tp = init_tp(spec.size, rank, spec.address, spec.devices[rank])
    try:
        model = DelayModel.from_dir(spec.model_dir, device=spec.devices[rank], dtype=getattr(torch, spec.dtype),
                                    tp=tp)
        return follow(model, tp, attention=make_attention(spec.attention, spec.devices[rank]), **spec.kv_options())
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
