"""The embedded demo model: a tiny random-weight Local-v1.5 checkpoint, created on first use.

`resolve_checkpoint(profile, model_dir)` is what every command serves: the checkpoint named, else
the profile's `model.path`, else the demo model under the profile with its length forced from the
text (random weights stop at random, often after one frame or none, whatever the profile).

`ensure_demo_model(cache_dir)` returns `<cache_dir>/demo-local-v1.5-<key>`, writing it first when
absent. The key hashes the generator version, the seed and both configs, so a change to any of
them makes a new directory instead of reusing a stale one. The directory is written under a
temporary name and renamed into place, so a reader never sees a half-written checkpoint and two
processes racing to create it both end up with one complete copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import msgspec

from profiles import Profile

log = logging.getLogger(__name__)

# Bump when the weight generator, tokenizer builder or directory layout changes.
GENERATOR_VERSION = "local-v1.5-demo/1"
DEMO_SEED = 0
RANDOM_WEIGHTS_WARNING = (
    "demo model %s has RANDOM weights (no real checkpoint given): the audio is noise-like and its "
    "stop head fires at random, so each request's length is forced from its text "
    "(model.force_length_from_text)"
)


def demo_key() -> str:
    """12 hex digits identifying what `make_checkpoint` would write for the demo model."""
    from stages.tools.make_checkpoint import codec_config, talker_config

    blob = json.dumps(
        {"version": GENERATOR_VERSION, "seed": DEMO_SEED,
         "talker": talker_config("tiny"), "codec": codec_config("tiny")},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_demo_model(cache_dir: str | Path) -> Path:
    """The demo checkpoint directory under `cache_dir` (`~` expanded), created if missing."""
    from stages.tools.make_checkpoint import make_checkpoint

    cache = Path(cache_dir).expanduser()
    target = cache / f"demo-local-v1.5-{demo_key()}"
    if not (target / "config.json").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
        try:
            make_checkpoint(tmp, variant="local-v1.5", size="tiny", seed=DEMO_SEED)
            try:
                os.rename(tmp, target)
                log.info("created demo model %s", target)
            except OSError:  # another process renamed its copy into place first
                if not (target / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.warning(RANDOM_WEIGHTS_WARNING, target)
    return target


def resolve_checkpoint(profile: Profile, model_dir: str | Path | None) -> tuple[Path, Profile]:
    """The checkpoint to serve and the profile to serve it under: `model_dir`, else the profile's
    `model.path` (both as given), else the demo model (created on first use) with
    `model.force_length_from_text` on, whatever `profile` says."""
    chosen = model_dir or profile.model.path
    if chosen:
        return Path(chosen).expanduser(), profile
    path = ensure_demo_model(profile.model.demo_cache_dir)
    if not profile.model.force_length_from_text:
        model = msgspec.structs.replace(profile.model, force_length_from_text=True)
        profile = msgspec.structs.replace(profile, model=model)
    return path, profile
