"""Tensor parallelism over torch.distributed: the rank group and Megatron's two linear layers.

A column-parallel linear splits the *output* features: rank r of n holds rows
`[r * out / n, (r + 1) * out / n)` of the `[out, in]` weight and computes its slice of the output
with no communication. A row-parallel linear splits the *input* features (columns of the weight):
each rank multiplies its slice of the input, and one all-reduce sums the partial outputs. A
column layer feeding a row layer therefore costs one all-reduce. The Qwen3 backbone
(`stages.models.qwen3`, `tp=` argument) puts q/k/v and gate/up in columns, so attention heads, KV heads
(and with them the KV cache) and FFN channels are split across ranks, and o_proj / down_proj in
rows: two all-reduces per decoder layer, one after attention and one after the MLP. Embeddings,
norms and output heads are replicated (see `docs/interfaces.md`, "Tensor parallelism").

Both layers hold only their shard. Checkpoints stay full-size: `read_shards` reads each parallel
layer's slice straight from the safetensors files (the rest whole), ready for strict loading.

`init_tp` joins a group: NCCL for device collectives on CUDA, gloo on CPU, plus a gloo group for
host-side broadcasts (step inputs). It sets the NVLink-multicast-off variables first.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

# Every process of a TP group runs with NVLink multicast off: the GPU hosts this was run on do not
# support it (NCCL NVLS, torch symmetric-memory multicast, NVSHMEM NVLS).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of its tensor-parallel group."""

    rank: int
    size: int
    group: dist.ProcessGroup  # device collectives: NCCL on CUDA, gloo on CPU
    cpu_group: dist.ProcessGroup  # gloo: host objects (step inputs), agreements on sizes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place; returns it."""
        dist.all_reduce(x, group=self.group)
        return x

    def bounds(self, length: int) -> tuple[int, int]:
        """This rank's contiguous [start, end) of `length` items (which must split evenly)."""
        if length % self.size:
            raise ValueError(f"{length} does not split into {self.size} ranks")
        step = length // self.size
        return self.rank * step, (self.rank + 1) * step

    def split(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous 1/size of `full` along `dim`."""
        start, end = self.bounds(full.shape[dim])
        return full.narrow(dim, start, end - start).contiguous()

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled over the gloo group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the rendezvous of a new group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tp(size: int, rank: int, init_address: str, device: torch.device | str,
            timeout: timedelta = DEFAULT_TIMEOUT) -> TPGroup:
    """Join the group of `size` ranks meeting at `init_address` (`tcp://127.0.0.1:PORT`).

    The process group is torch.distributed's default one: one TP group per process.
    """
    os.environ.update(MULTICAST_OFF)
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_address, world_size=size, rank=rank, timeout=timeout)
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(rank, size, world, cpu_group)


def destroy_tp() -> None:
    """Leave the group (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class ColumnParallelLinear(nn.Module):
    """y[..., out / size] = x[..., in] @ W_r^T: this rank's slice of the outputs; no communication."""

    split_dim = 0  # of the [out, in] weight

    def __init__(self, in_features: int, out_features: int, tp: TPGroup) -> None:
        super().__init__()
        if out_features % tp.size:
            raise ValueError(f"{out_features} output features do not split into {tp.size} ranks")
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features))  # [out / size, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """The checkpoint's `[out, in]` weight -> this rank's `[out / size, in]` rows."""
        return self.tp.split(full, self.split_dim)


class RowParallelLinear(nn.Module):
    """y[..., out] = sum over ranks of x_r[..., in / size] @ W_r^T: one all-reduce per call."""

    split_dim = 1  # of the [out, in] weight

    def __init__(self, in_features: int, out_features: int, tp: TPGroup) -> None:
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"{in_features} input features do not split into {tp.size} ranks")
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))  # [out, in / size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """The checkpoint's `[out, in]` weight -> this rank's `[out, in / size]` columns."""
        return self.tp.split(full, self.split_dim)


def column_linear(in_features: int, out_features: int, tp: TPGroup | None) -> nn.Module:
    """A bias-free linear, column-parallel when `tp` is given."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=False)
    return ColumnParallelLinear(in_features, out_features, tp)


def row_linear(in_features: int, out_features: int, tp: TPGroup | None) -> nn.Module:
    """A bias-free linear, row-parallel (output all-reduced) when `tp` is given."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=False)
    return RowParallelLinear(in_features, out_features, tp)


def read_shards(module: nn.Module, files: Iterable[str | Path], *, rename: Iterable[tuple[str, str]] = (),
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors of full-size safetensors `files` as `module` holds them, on the host.

    A parallel layer's weight is read as this rank's slice only (rows or columns); every other
    tensor whole. rename: (regex, replacement) pairs applied in order (as
    `stages.runtime.checkpoint.load_weights` does); the result is keyed by the renamed names, ready for
    `load_weights` without renames. Floating tensors are cast to `dtype` when given.
    """
    rules = [(re.compile(p), r) for p, r in rename]
    owners = {f"{name}.weight": m for name, m in module.named_modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():
                name = stored
                for pat, rep in rules:
                    name = pat.sub(rep, name)
                owner = owners.get(name)
                if owner is None:
                    t = f.get_tensor(stored)
                else:
                    part = f.get_slice(stored)
                    start, end = owner.tp.bounds(part.get_shape()[owner.split_dim])
                    t = part[start:end] if owner.split_dim == 0 else part[:, start:end]
                out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out
