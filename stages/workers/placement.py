"""Where the worker processes run: the device of each replica, the environment every worker
inherits, and where their compile caches live."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from profiles import Profile
from stages.runtime.tensor_parallel import MULTICAST_OFF


def resolve_device(device: str) -> str:
    """A `model.device` setting with `auto` resolved: cuda when torch sees a GPU, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class PlacementError(ValueError):
    """The replicas and their tensor-parallel groups do not fit the devices this host has."""


def replica_devices(profile: Profile) -> list[str]:
    """The device of each of `engine.replicas` replicas (its talker's first TP rank and codec).

    `engine.devices` when given (checked against the GPU count on cuda); else on cpu every
    replica gets `cpu`, on cuda replica r gets `cuda:{r * talker.tensor_parallel}` and all of them
    must fit the GPUs torch sees (`PlacementError` naming the keys otherwise)."""
    replicas, tp = profile.engine.replicas, profile.talker.tensor_parallel
    devices = list(profile.engine.devices)
    if not devices:
        device = resolve_device(profile.model.device)
        if device == "cpu":
            return ["cpu"] * replicas
        devices = [f"cuda:{r * tp}" for r in range(replicas)]
    if devices[0].startswith("cuda"):
        import torch

        have = torch.cuda.device_count()
        need = max((int(d.split(":")[1]) if ":" in d else 0) + tp for d in devices)
        if need > have:
            raise PlacementError(
                f"engine.replicas ({replicas}) on {devices} with talker.tensor_parallel ({tp}) "
                f"need {need} GPUs, this host has {have}: lower engine.replicas or "
                f"talker.tensor_parallel, or set engine.devices")
    return devices


def worker_environment() -> dict[str, str]:
    """Variables every worker process the launcher starts runs with: NVLink multicast off
    (NCCL NVLS, torch symmetric-memory multicast, NVSHMEM NVLS), as `stages.runtime.tensor_parallel`
    sets them."""
    return dict(MULTICAST_OFF)


INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"  # inductor: compiled graphs, AOT autograd, autotuning
TRITON_CACHE_VAR = "TRITON_CACHE_DIR"  # Triton: compiled kernels (inductor's and ours)
CACHE_SWITCHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1",  # inductor's compiled-graph cache, on
                  "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}  # AOT autograd's cache of traced graphs, on


def compile_cache_environment(profile: Profile, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables that put a worker's compile caches in `engine.compile_cache_dir` (its
    `inductor/` and `triton/` folders) with inductor's graph and AOT autograd caches on, so a later
    start finds what this one compiled. Set in the worker before torch compiles anything
    (`WorkerSpec.env`). Each entry is keyed by what made it (graph, settings, torch and Triton
    versions, device), so servers of other profiles or checkpoints share the folder safely.
    Nothing for a variable `environ` already sets (the operator's choice wins), nor when the
    setting is null or its folder cannot be made (torch's own places then)."""
    root = profile.engine.compile_cache_dir
    if root is None or not creatable(Path(root).expanduser()):
        return {}
    root = Path(root).expanduser().resolve()
    wanted = {INDUCTOR_CACHE_VAR: str(root / "inductor"), TRITON_CACHE_VAR: str(root / "triton"), **CACHE_SWITCHES}
    return {name: value for name, value in wanted.items() if name not in environ}


def creatable(folder: Path) -> bool:
    """Whether `folder` exists and is writable, or could be made: its nearest existing parent is
    writable (nothing is made here: torch and Triton make their folders on first write)."""
    while not folder.exists():
        if folder.parent == folder:
            return False
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
