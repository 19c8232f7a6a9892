"""How one request samples: the one settings record of the API side, the wire and the talker runner.

A variant resolves it per request (defaults, overrides, seed, forced length); `ipc.messages.Submit`
carries it as it is (`array_like`: encoded as a positional array, so field order is the schema:
append new fields at the end, with defaults); the runner reads it into its sampling slots.
"""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """How one request samples. Defaults: MOSS-TTS-Local-v1.5 model card (audio T 1.7, top-p 0.8,
    top-k 25, repetition penalty 1.0; stop head T 1.0, top-k 50, top-p 1.0).

    `greedy`: argmax everywhere (after the repetition penalty), as upstream `do_sample=False`.
    `seed`: the request's random stream. `max_new_frames`: frame budget (finish reason "length").
    `forced_frames`: stop after exactly this many frames regardless of the stop head (random
    weights stop at random); None leaves the decision to the model.
    """

    temperature: float = 1.7
    top_p: float = 0.8
    top_k: int = 25
    repetition_penalty: float = 1.0
    text_temperature: float = 1.0
    text_top_p: float = 1.0
    text_top_k: int = 50
    greedy: bool = False
    seed: int = 0
    max_new_frames: int = 4096
    forced_frames: int | None = None
