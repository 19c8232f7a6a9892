"""Where the worker processes run: the device of each replica, and the environment every worker
inherits."""

from __future__ import annotations

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
