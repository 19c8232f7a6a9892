"""Which prompt set `mossvox bench serve` sends: by name, by path, or ``auto`` for the served model.

``auto`` gives each model prompts in the fields it uses: ``synthetic-sound-effect`` for
MOSS-SoundEffect (a sound description), ``synthetic-voice-design`` for MOSS-VoiceGenerator (a text
and a voice description), and ``synthetic-en1088`` (a reference clip and its transcript with each
text) for the others.
"""

from __future__ import annotations

import os

from bench.dataset import DEFAULT_CACHE_DIR, SYNTHETIC_NAME, SeedTtsDataset, SyntheticEn1088
from bench.text_prompts import SOUND_EFFECT_NAME, TEXT_SETS, VOICE_DESIGN_NAME, SoundEffect, VoiceDesign

AUTO = "auto"
AUTO_SETS = {"moss-sound-effect": SOUND_EFFECT_NAME, "moss-voice-generator": VOICE_DESIGN_NAME}
NAMES = (AUTO, SYNTHETIC_NAME, *TEXT_SETS)

PromptSet = SeedTtsDataset | SyntheticEn1088 | SoundEffect | VoiceDesign


def load_dataset(spec: str, cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR, *,
                 model: str | None = None) -> PromptSet:
    """A named synthetic set, the path of a Seed-TTS-format directory, or ``auto``: the set that
    fits ``model``, the served model's name (`AUTO_SETS`; otherwise ``synthetic-en1088``)."""
    if spec == AUTO:
        spec = AUTO_SETS.get(model or "", SYNTHETIC_NAME)
    if spec == SYNTHETIC_NAME:
        return SyntheticEn1088(cache_dir)
    if spec in TEXT_SETS:
        return TEXT_SETS[spec]()
    return SeedTtsDataset(spec)
