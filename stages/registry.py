"""The variant registry: which `Variant` serves a checkpoint, read from its `config.json`.

A family registers itself by subclassing `stages.variant.Variant` with the `model_types` it serves;
`FAMILIES` names the modules of the shipped families, so that asking the registry imports them.
Adding a family is its own folder plus one line here. A variant defined anywhere else (a test
module, say) is found the same way once its module has been imported.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from profiles import Profile
from stages.runtime.checkpoint import read_config
from stages.variant import UnknownModel, Variant

FAMILIES = (
    "stages.models.local_v15.variant",
    "stages.models.delay.variant",
    "stages.models.realtime.variant",
)


def registered_variants() -> list[type[Variant]]:
    """Every `Variant` subclass that serves a model type: the shipped families first, in order."""
    for module in FAMILIES:
        importlib.import_module(module)
    found, todo = [], list(Variant.__subclasses__())
    while todo:
        cls = todo.pop(0)
        todo.extend(cls.__subclasses__())
        if cls.model_types and cls not in found:
            found.append(cls)
    return found


def variant_class(model_dir: str | Path, config: dict) -> type[Variant]:
    """The variant serving a checkpoint whose `config.json` is `config` (`UnknownModel` if none)."""
    model_type = config.get("model_type")
    variants = registered_variants()
    for cls in variants:
        if model_type in cls.model_types:
            return cls
    known = ", ".join(f"{t!r} = {cls.description}" for cls in variants for t in cls.model_types)
    raise UnknownModel(f"{model_dir}/config.json: model_type {model_type!r} is not served (known: {known})")


def load_variant(model_dir: str | Path, profile: Profile) -> Variant:
    """The variant serving the checkpoint in `model_dir` under `profile` (cheap: no weights)."""
    config = read_config(model_dir)
    return variant_class(model_dir, config)(model_dir, profile, config)
