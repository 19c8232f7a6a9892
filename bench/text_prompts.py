"""Prompt sets without reference clips, for the models that take none, in their own fields.

- ``synthetic-voice-design`` (MOSS-VoiceGenerator): the 1088 target texts of
  ``synthetic-en1088``, each with a voice description sent as ``instructions``.
- ``synthetic-sound-effect`` (MOSS-SoundEffect): 1088 sound descriptions sent as ``input``, about
  as long as those target texts on average (about 63 characters; 28-133), so a forced length
  from the text gives each set about the same amount of audio per request.

Both are deterministic (seeded numpy, like ``synthetic-en1088``) and need no files:
``prepare`` has nothing to make.
"""

from __future__ import annotations

import numpy as np

from bench.dataset import Prompt, synthetic_spec

VOICE_DESIGN_NAME = "synthetic-voice-design"
SOUND_EFFECT_NAME = "synthetic-sound-effect"
_NUM_PROMPTS = 1088
_SEED = 1089  # part of the sets' identity, not the benchmark's --seed
# the length a description grows to at least; whole clauses overshoot it by about 18 characters
_CHARS_MEAN, _CHARS_SD, _CHARS_RANGE = 45.0, 20.0, (16, 140)

_AGES = ("young", "middle-aged", "elderly", "teenage", "mature")
_SPEAKERS = ("woman", "man", "narrator", "girl", "boy", "storyteller", "announcer")
_QUALITIES = ("warm", "bright", "husky", "soft", "clear", "deep", "breathy", "crisp", "raspy", "gentle")
_PACES = ("speaking slowly", "speaking quickly", "at an even pace", "with long pauses", "with energy")
_MOODS = ("calm", "cheerful", "serious", "tired", "excited", "thoughtful", "friendly", "stern")

_SOURCES = ("rain", "heavy rain", "thunder", "wind", "a crackling fire", "ocean waves", "a stream",
            "footsteps", "a door", "a distant train", "church bells", "birdsong", "a dog barking",
            "traffic", "a kettle", "a clock ticking", "leaves rustling", "a crowd", "a busy market",
            "an old engine", "horses", "a bicycle bell", "dishes clattering", "a typewriter")
_ACTIONS = ("falling on", "rolling over", "moving through", "echoing in", "drifting across", "tapping on",
            "rumbling under", "passing by", "fading into", "creaking in")
_PLACES = ("a tin roof", "a quiet valley", "an empty hall", "a narrow street", "the forest",
           "a wooden cabin", "the harbor", "a stone bridge", "an open field", "a small kitchen",
           "a train station", "a mountain pass", "a city park", "the night")
_EXTRAS = ("with distant thunder", "at dawn", "late at night", "in the background", "close to the listener",
           "with a light breeze", "slowly growing louder", "now and then", "under a steady hum",
           "with people talking softly")


class VoiceDesign:
    """``synthetic-voice-design``: text to speak plus the voice to speak it in, no clip."""

    name = VOICE_DESIGN_NAME

    def __init__(self) -> None:
        rng = np.random.default_rng([_SEED, 1])
        _, rows = synthetic_spec()
        self.prompts = [Prompt(f"voice_design_{k:04d}", None, None, target, _voice(rng))
                        for k, (_, _, _, target) in enumerate(rows)]

    def prepare(self, prompts: list[Prompt]) -> None:
        """Nothing to make: the set has no clips."""


class SoundEffect:
    """``synthetic-sound-effect``: a sound description per prompt, no clip, no transcript."""

    name = SOUND_EFFECT_NAME

    def __init__(self) -> None:
        rng = np.random.default_rng([_SEED, 2])
        lo, hi = _CHARS_RANGE
        self.prompts = [Prompt(f"sound_effect_{k:04d}", None, None,
                               _sound(rng, int(np.clip(round(rng.normal(_CHARS_MEAN, _CHARS_SD)), lo, hi))))
                        for k in range(_NUM_PROMPTS)]

    def prepare(self, prompts: list[Prompt]) -> None:
        """Nothing to make: the set has no clips."""


TEXT_SETS = {VOICE_DESIGN_NAME: VoiceDesign, SOUND_EFFECT_NAME: SoundEffect}


def _pick(rng: np.random.Generator, words: tuple[str, ...]) -> str:
    return words[int(rng.integers(len(words)))]


def _voice(rng: np.random.Generator) -> str:
    """"A warm, middle-aged woman, speaking slowly, calm." and the like."""
    return (f"A {_pick(rng, _QUALITIES)}, {_pick(rng, _AGES)} {_pick(rng, _SPEAKERS)}, "
            f"{_pick(rng, _PACES)}, {_pick(rng, _MOODS)}.")


def _sound(rng: np.random.Generator, min_chars: int) -> str:
    """Sound clauses ("rain falling on a tin roof, with distant thunder") until the description
    is at least ``min_chars`` long, capitalised, with a full stop."""
    parts = [f"{_pick(rng, _SOURCES)} {_pick(rng, _ACTIONS)} {_pick(rng, _PLACES)}"]
    while len(", ".join(parts)) < min_chars - 1:
        parts.append(_pick(rng, _EXTRAS) if rng.random() < 0.6 else
                     f"{_pick(rng, _SOURCES)} {_pick(rng, _ACTIONS)} {_pick(rng, _PLACES)}")
    text = ", ".join(parts)
    return text[0].upper() + text[1:] + "."
