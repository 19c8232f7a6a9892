"""Checkpoint directories: config, sharded safetensors, and strict loading into modules.

A checkpoint directory holds `config.json`, one or more `*.safetensors` files (with or without a
`model.safetensors.index.json`) and, for talkers, tokenizer files. Loading is strict: every
parameter of the module must be found with the right shape, and every tensor of the file must be
used (or explicitly ignored); all problems are reported together in one `CheckpointError`.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: names every missing, extra or mis-shaped tensor."""


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json")
    return json.loads(path.read_text())


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a checkpoint, from its index when there is one."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{model_dir}: index names missing files: {', '.join(missing)}")
    return files


def read_state_dict(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint; floating tensors are cast to `dtype` when given. Logged: each
    file of several as it is read (n of N, bytes so far, rate), then the whole."""
    state: dict[str, torch.Tensor] = {}
    files = safetensors_files(model_dir)
    total = sum(path.stat().st_size for path in files)
    done, t0 = 0, time.perf_counter()
    for i, path in enumerate(files, 1):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                state[name] = t
        done += path.stat().st_size
        if len(files) > 1:
            log.info("weights: file %d of %d (%s): %s of %s, %s", i, len(files), path.name, size(done),
                     size(total), rate(done, time.perf_counter() - t0))
    log.info("weights: %s from %d file(s) of %s to %s in %.1f s, %s", size(total), len(files), model_dir,
             device, time.perf_counter() - t0, rate(total, time.perf_counter() - t0))
    return fold_weight_norm(state)


def size(n: int) -> str:
    """Bytes for a log line: '812 MB', '16.20 GB'."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def rate(n: int, seconds: float) -> str:
    """Bytes a second for a log line: '1.43 GB/s'."""
    return f"{size(int(n / seconds))}/s" if seconds > 0 else "at once"


def fold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace weight-norm pairs (g, v) by the plain weight `g * v / ||v||` (norm over dims > 0).

    Accepts `*.parametrizations.weight.original0/1` (torch parametrize) and legacy
    `*.weight_g` / `*.weight_v`.
    """
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        for g_suffix, v_suffix in ((".parametrizations.weight.original0", ".parametrizations.weight.original1"),
                                   (".weight_g", ".weight_v")):
            if name.endswith(g_suffix):
                pairs.setdefault(name[: -len(g_suffix)], {})["g"] = t
                break
            if name.endswith(v_suffix):
                pairs.setdefault(name[: -len(v_suffix)], {})["v"] = t
                break
        else:
            out[name] = t
    for prefix, gv in pairs.items():
        if set(gv) != {"g", "v"}:
            raise CheckpointError(f"weight norm of {prefix}: only {sorted(gv)} present")
        g, v = gv["g"].float(), gv["v"].float()
        norm = v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))
        out[f"{prefix}.weight"] = (g * v / norm).to(gv["v"].dtype)
    return out


def load_weights(
    module: nn.Module,
    state: Mapping[str, torch.Tensor],
    *,
    rename: Iterable[tuple[str, str]] = (),
    tied: Mapping[str, str] | None = None,
    ignore: Iterable[str] = (),
) -> None:
    """Copy checkpoint tensors into `module` by name, strictly.

    rename: (regex, replacement) pairs applied in order to every checkpoint name.
    tied:   module name -> checkpoint name to take it from when the module name is absent
            (tied weights dropped by save_pretrained).
    ignore: regexes of checkpoint names that may be present and are dropped.
    """
    rules = [(re.compile(p), r) for p, r in rename]
    ignored = [re.compile(p) for p in ignore]
    renamed: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        for pat, rep in rules:
            name = pat.sub(rep, name)
        if any(p.fullmatch(name) for p in ignored):
            continue
        renamed[name] = t
    targets = dict(module.named_parameters())
    targets.update({n: b for n, b in module.named_buffers() if n in module.state_dict()})
    tied = dict(tied or {})
    missing, shape_errors = [], []
    used: set[str] = set()
    for name, target in targets.items():
        source = name if name in renamed else tied.get(name)
        if source is None or source not in renamed:
            missing.append(name)
            continue
        t = renamed[source]
        used.add(source)
        if tuple(t.shape) != tuple(target.shape):
            shape_errors.append(f"{name}: checkpoint {tuple(t.shape)} vs model {tuple(target.shape)}")
            continue
        with torch.no_grad():
            target.copy_(t.to(dtype=target.dtype, device=target.device))
    unexpected = sorted(set(renamed) - used)
    if missing or unexpected or shape_errors:
        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): {', '.join(sorted(missing))}")
        if unexpected:
            parts.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected)}")
        if shape_errors:
            parts.append(f"mis-shaped tensors ({len(shape_errors)}): {'; '.join(shape_errors)}")
        raise CheckpointError(f"{type(module).__name__}: " + " | ".join(parts))
