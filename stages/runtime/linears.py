"""Swapping a module's named linear layers for another implementation after loading."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn


def replace_linears(module: nn.Module, names: Iterable[str], convert: Callable[[nn.Module], nn.Module],
                    done: type[nn.Module]) -> int:
    """Replace every submodule of `module` whose own name is in `names` (e.g. "q_proj",
    "gate_up_proj") and that is not already a `done` by `convert(submodule)`; returns how many
    were replaced."""
    wanted = set(names)
    targets = [(parent, name) for parent in module.modules()
               for name, child in parent.named_children()
               if name in wanted and not isinstance(child, done)]
    for parent, name in targets:
        setattr(parent, name, convert(getattr(parent, name)))
    return len(targets)
