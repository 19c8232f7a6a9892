"""Seeded random weights for a module, written shard by shard in the real checkpoint layout.

The module is built on the `meta` device (names and shapes only, no memory). Every checkpoint
tensor gets its own `torch.Generator` seeded from `sha256(f"{seed}:{name}")[:8]` (the golden
fixtures' scheme), so a tensor's values depend only on (seed, name, shape) and not on the order
or sharding of the write. Tensors are generated and saved one shard at a time: the peak memory is
one shard, never the whole model. Within a shard, tensors are generated on several threads (torch
releases the GIL; each tensor has its own generator, so the values do not depend on the threads):
CPU normal sampling runs at ~100 M values a second on one core, so an 8B model took ~100 s on one
thread.

Initialisation (docs/model_facts.md, "Golden fixtures", with the talker std capped at 1/sqrt(fan_in) so that
full-size random models stay finite):
* talker: matrices/embeddings N(0, min(0.1, fan_in^-1/2)^2); norm weights 1 + 0.1 N; biases 0.05 N.
* codec:  matrices N(0, 1/fan_in); codebooks N(0, 1); LayerNorm weight 1 + 0.1 N, bias 0.05 N;
          LayerScale 0.3 + 0.1 N; 1x1 convs stored weight-normed: g = |1 + 0.1 N|, v = N(0, 1/fan_in).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from torch import nn

from stages.runtime.checkpoint import INDEX_FILE

MAX_THREADS = 8  # tensors generated at once (each holds its fp32 noise while it is made)

Init = Literal["matrix", "norm_weight", "bias", "codebook", "layer_scale", "wn_g", "wn_v"]
Style = Literal["talker", "codec"]
Adjust = Callable[[str, torch.Tensor], torch.Tensor]  # (name, fp32 tensor) -> the tensor to write


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor to generate: its stored name, shape and initialisation rule."""

    name: str
    shape: tuple[int, ...]
    init: Init

    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class WrittenWeights:
    """What `write_weights` wrote: file names, parameter count and bytes on disk (tensor data)."""

    files: tuple[str, ...]
    num_params: int
    total_bytes: int


def tensor_seed(seed: int, name: str) -> int:
    return int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:8], 16)


def _fan_in(shape: tuple[int, ...]) -> int:
    return max(1, math.prod(shape[1:]))


def random_tensor(spec: TensorSpec, seed: int, style: Style, dtype: torch.dtype,
                  adjust: Adjust | None = None) -> torch.Tensor:
    """The tensor of `spec`, generated in fp32 from its own seeded generator, given to
    `adjust(name, tensor)` if any (e.g. `stages.tools.outlier_channels`), then cast."""
    gen = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    noise = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    if spec.init == "matrix":
        std = 1 / math.sqrt(_fan_in(spec.shape))
        t = noise.mul_(min(0.1, std) if style == "talker" else std)
    elif spec.init == "wn_v":
        t = noise.mul_(1 / math.sqrt(_fan_in(spec.shape)))
    elif spec.init == "norm_weight":
        t = noise.mul_(0.1).add_(1.0)
    elif spec.init == "wn_g":
        t = noise.mul_(0.1).add_(1.0).abs_()
    elif spec.init == "layer_scale":
        t = noise.mul_(0.1).add_(0.3)
    elif spec.init == "bias":
        t = noise.mul_(0.05)
    else:  # codebook
        t = noise
    if adjust is not None:
        t = adjust(spec.name, t)
    return t.to(dtype)


def module_specs(
    module: nn.Module,
    style: Style,
    *,
    weight_norm: Callable[[str, nn.Module], bool] = lambda name, owner: False,
) -> list[TensorSpec]:
    """Checkpoint tensors of a (meta) module, in state-dict order.

    Tied parameters (one Parameter under several names) are stored once, under the first name, as
    save_pretrained does. `weight_norm(name, owner)` selects weights stored as a weight-norm pair
    `*.parametrizations.weight.original0/1` (g `[out, 1, ...]`, v the full shape).
    """
    owners = {name: mod for name, mod in module.named_modules()}
    seen: set[int] = set()
    specs: list[TensorSpec] = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        prefix, _, leaf = name.rpartition(".")
        owner = owners[prefix]
        shape = tuple(tensor.shape)
        kind = type(owner).__name__
        if "Norm" in kind:
            init: Init = "norm_weight" if leaf == "weight" else "bias"
        elif leaf == "scale" or "LayerScale" in kind:
            init = "layer_scale"
        elif leaf == "bias" or len(shape) < 2:
            init = "bias"
        elif isinstance(owner, nn.Embedding) and style == "codec":
            init = "codebook"
        elif weight_norm(name, owner):
            g_shape = (shape[0],) + (1,) * (len(shape) - 1)
            specs.append(TensorSpec(f"{prefix}.parametrizations.weight.original0", g_shape, "wn_g"))
            specs.append(TensorSpec(f"{prefix}.parametrizations.weight.original1", shape, "wn_v"))
            continue
        else:
            init = "matrix"
        specs.append(TensorSpec(name, shape, init))
    return specs


def plan_shards(specs: Iterable[TensorSpec], dtype: torch.dtype, max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy split in order: a shard closes before the tensor that would push it past the limit."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel() * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def shard_file_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_weights(
    specs: list[TensorSpec],
    out_dir: str | Path,
    *,
    seed: int,
    style: Style,
    dtype: torch.dtype,
    max_shard_bytes: int,
    on_file: Callable[[Path], None] | None = None,
    threads: int | None = None,
    adjust: Adjust | None = None,
) -> WrittenWeights:
    """Generate and save `specs`: one `model.safetensors`, or numbered shards plus the index.

    on_file: called with each weight file's path once it is written (progress reporting).
    threads: tensors generated at once (default: the CPUs, at most `MAX_THREADS`).
    adjust: changes each tensor before it is cast and written (`random_tensor`).
    """
    out_dir = Path(out_dir)
    shards = plan_shards(specs, dtype, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    workers = threads or min(MAX_THREADS, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i, shard in enumerate(shards):
            file_name = shard_file_name(i, len(shards))
            made = pool.map(lambda spec: random_tensor(spec, seed, style, dtype, adjust), shard)
            tensors = {spec.name: t for spec, t in zip(shard, made)}
            total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
            del tensors
            if on_file is not None:
                on_file(out_dir / file_name)
            weight_map.update({spec.name: file_name for spec in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    num_params = sum(spec.numel() for spec in specs)
    return WrittenWeights(tuple(shard_file_name(i, len(shards)) for i in range(len(shards))), num_params, total_bytes)
