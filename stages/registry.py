"""Variant registry: the one door from `engine/` and `api/` into model-specific code.

`load_variant(model_dir, profile)` reads `config.json` and returns the `Variant` that serves it.
A `Variant` is cheap to build (config, tokenizer, prompt processor; no weights): every API process
holds one to build prompts, and each worker process builds one to make its runner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import msgspec
import numpy as np

from ipc.messages import Sampling
from profiles import Profile
from stages.runtime.checkpoint import read_config


class SpeechJobLike(Protocol):
    """What a request adapter reads from an engine-level speech job (`engine.client.SpeechJob`)."""

    text: str
    language: str | None
    instructions: str | None
    ref_codes: np.ndarray | None      # [T, n_vq] int64
    ref_text: str | None
    sampling: dict[str, Any]
    forced_frames: int | None


class Variant(Protocol):
    """Everything the engine needs to know about one model family."""

    name: str
    n_vq: int
    sample_rate: int
    channels: int
    frame_rate: float
    samples_per_frame: int            # per channel
    sampling_defaults: Sampling

    def build_request(self, job: SpeechJobLike) -> tuple[np.ndarray, Sampling]:
        """The request adapter: prompt `[S, 1 + n_vq]` int64 and the resolved sampling settings."""

    def prime_frames(self, job: SpeechJobLike) -> int:
        """How many trailing prompt rows the codec decodes first as left context (0: none)."""

    def make_talker_runner(self, device: str) -> Any:
        """The talker runner (loads the talker weights) for this process."""

    def make_codec_runner(self, device: str) -> Any:
        """The codec runner (loads the audio tokenizer) for this process."""


def to_wire(params: Any) -> Sampling:
    """The wire record of a `stages.runtime.sampling.SamplingParams` (same fields)."""
    return Sampling(**msgspec.structs.asdict(params))


def from_wire(sampling: Sampling) -> Any:
    """The runner's `stages.runtime.sampling.SamplingParams` of a wire record."""
    from stages.runtime.sampling import SamplingParams

    return SamplingParams(**msgspec.structs.asdict(sampling))


class UnknownModel(ValueError):
    """config.json names a model family mossvox does not serve."""


def load_variant(model_dir: str | Path, profile: Profile) -> Variant:
    """The variant serving the checkpoint in `model_dir`, chosen from its `config.json`."""
    config = read_config(model_dir)
    model_type = config.get("model_type")
    if profile.model.variant is not None and model_type != "moss_tts_delay":
        raise UnknownModel(f"model.variant {profile.model.variant!r} names a Delay-family variant, but "
                           f"{model_dir}/config.json has model_type {model_type!r}")
    if profile.talker.tensor_parallel > 1 and model_type != "moss_tts_delay":
        raise UnknownModel(f"talker.tensor_parallel {profile.talker.tensor_parallel} splits Delay-family talkers "
                           f"only, but {model_dir}/config.json has model_type {model_type!r}")
    if model_type == "moss_tts_local":
        from stages.models.local_v15.variant import LocalV15Variant

        return LocalV15Variant(Path(model_dir), profile, config)
    if model_type == "moss_tts_delay" and "local_num_layers" in config:
        raise UnknownModel(f"{model_dir}/config.json is MOSS-TTS-Local-Transformer v1 (moss_tts_delay "
                           f"with local_num_layers), which is not served; v1.5 (moss_tts_local) is")
    if model_type == "moss_tts_delay":
        from stages.models.delay.variant import DelayVariant

        return DelayVariant(Path(model_dir), profile, config)
    if model_type == "moss_tts_realtime":
        from stages.models.realtime.variant import RealtimeVariant

        return RealtimeVariant(Path(model_dir), profile, config)
    raise UnknownModel(
        f"{model_dir}/config.json: model_type {model_type!r} is not served (known: "
        f"'moss_tts_local' = MOSS-TTS-Local-Transformer-v1.5, 'moss_tts_delay' = MOSS-TTS / TTSD / "
        f"SoundEffect / VoiceGenerator, 'moss_tts_realtime' = MOSS-TTS-Realtime)")


def resolve_device(profile: Profile) -> str:
    """`model.device` with `auto` resolved: cuda when torch sees a GPU, else cpu."""
    if profile.model.device != "auto":
        return profile.model.device
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
        device = resolve_device(profile)
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
    from stages.runtime.tensor_parallel import MULTICAST_OFF

    return dict(MULTICAST_OFF)


def talker_worker_main(spec: Any) -> None:
    """Entry point of the talker process (spawn target), reached through the registry."""
    from stages.workers.talker import main

    main(spec)


def codec_worker_main(spec: Any) -> None:
    """Entry point of the codec process (spawn target), reached through the registry."""
    from stages.workers.codec import main

    main(spec)
