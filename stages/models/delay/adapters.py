"""Request adapters of the Delay variants: request fields -> prompt, with per-variant rules and
sampling defaults (docs/model_facts.md, "Delay family").

| variant          | text                          | references                        | other             |
|------------------|-------------------------------|-----------------------------------|-------------------|
| moss-tts         | what to say (required)        | 0 or 1; with `ref_text`: continuation | language, tokens, instructions |
| ttsd             | dialogue with [S1]..[S5] tags; untagged text is [S1]'s | one per speaker (None = no voice); each needs its transcript; cloning = continuation on the concatenated references | language, tokens |
| sound-effect     | the sound description -> the template's "Ambient Sound" field; text stays None | not used | tokens |
| voice-generator  | what to say (required)        | not used; `instructions` (the voice description) required | language, tokens |

`USED_FIELDS` says which optional job fields (`speech.job.OPTIONAL_FIELDS`) each variant uses;
the variant clears the others before its adapter runs, so an adapter never sees a field its
model has no use for. Every rule violation is an `AdapterError` (a ValueError; the API answers
400) whose message says what to change. Which variant a checkpoint is cannot be read from its
config (all are `MossTTSDelayModel`); `variant_for_config` takes an explicit name, else decides
by n_vq 32 -> moss-tts, and otherwise asks for the name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from speech.job import OptionalField
from speech.sampling import SamplingParams
from stages.models.delay.processor import DelayProcessor
from stages.variant import AdapterError

MAX_SPEAKERS = 5
DEFAULT_SPEAKER = "[S1]"  # who speaks TTSD text that carries no speaker tags
_SPEAKER_TAG = re.compile(r"\[S(\d+)\]")


@dataclass(frozen=True)
class DelayRequest:
    """The request fields a Delay adapter reads. `ref_codes[i]` / `ref_texts[i]` belong to speaker
    S{i+1} (TTSD) or are the single reference (other variants); codes are `[T, n_vq]` int64."""

    text: str | None
    instructions: str | None = None
    language: str | None = None
    tokens: int | None = None
    ref_codes: Sequence[np.ndarray | None] = field(default_factory=tuple)
    ref_texts: Sequence[str | None] = field(default_factory=tuple)


def _text_defaults(**audio) -> SamplingParams:
    # text channel: upstream generate defaults (T 1.5, top-p 1.0, top-k 50), no repetition penalty
    return SamplingParams(text_temperature=1.5, text_top_p=1.0, text_top_k=50, **audio)


# Model-card / CLI defaults (docs/model_facts.md, "Delay family"); max_new_frames from each CLI's max_new_tokens.
SAMPLING_DEFAULTS = {
    "moss-tts": _text_defaults(temperature=1.7, top_p=0.8, top_k=25, repetition_penalty=1.0, max_new_frames=4096),
    "ttsd": _text_defaults(temperature=1.1, top_p=0.9, top_k=50, repetition_penalty=1.1, max_new_frames=2000),
    "voice-generator": _text_defaults(temperature=1.5, top_p=0.6, top_k=50, repetition_penalty=1.1,
                                      max_new_frames=4096),
    "sound-effect": _text_defaults(temperature=1.5, top_p=0.6, top_k=50, repetition_penalty=1.2,
                                   max_new_frames=4096),
}


def _required(value: str | None, what: str) -> str:
    if value is None or not str(value).strip():
        raise AdapterError(f"{what} is required")
    return str(value)


def _join(prefix: str, text: str) -> str:
    """Transcript + target text; a space at the seam unless one is there (normalisation drops it
    between CJK characters)."""
    if not prefix or prefix[-1].isspace() or text[:1].isspace():
        return prefix + text
    return f"{prefix} {text}"


def _references(request: DelayRequest) -> list[np.ndarray]:
    return [c for c in request.ref_codes if c is not None]


def build_moss_tts(processor: DelayProcessor, r: DelayRequest) -> np.ndarray:
    text = _required(r.text, "input text")
    refs = _references(r)
    ref_texts = [t for t in r.ref_texts if t]
    if len(refs) > 1 or len(ref_texts) > 1:
        raise AdapterError("MOSS-TTS takes at most one reference audio (use a TTSD model for several speakers)")
    fields = dict(language=r.language, tokens=r.tokens, instruction=r.instructions)
    if ref_texts and not refs:
        raise AdapterError("ref_text needs reference audio")
    if refs and ref_texts:  # reference transcript: continue the reference clip
        return processor.build_prompt(_join(ref_texts[0], text), prompt_codes=refs[0], **fields)
    return processor.build_prompt(text, references=refs, **fields)


def build_ttsd(processor: DelayProcessor, r: DelayRequest) -> np.ndarray:
    text = _required(r.text, "dialogue text")
    tags = [int(t) for t in _SPEAKER_TAG.findall(text)]
    if not tags:  # one speaker: S1, whose voice is the first reference (if any)
        text, tags = f"{DEFAULT_SPEAKER} {text.strip()}", [1]
    if max(tags) > MAX_SPEAKERS or min(tags) < 1:
        raise AdapterError(f"TTSD speaker tags go from [S1] to [S{MAX_SPEAKERS}]")
    codes = list(r.ref_codes)
    texts = list(r.ref_texts) + [None] * max(0, len(codes) - len(r.ref_texts))
    if len(codes) > MAX_SPEAKERS or len(r.ref_texts) > MAX_SPEAKERS:
        raise AdapterError(f"TTSD takes at most {MAX_SPEAKERS} references, one per speaker")
    fields = dict(language=r.language, tokens=r.tokens)
    cloned = [i for i, c in enumerate(codes) if c is not None]
    for i in range(max(len(codes), len(texts))):
        has_audio = i < len(codes) and codes[i] is not None
        if has_audio != bool(texts[i]):
            raise AdapterError(f"speaker S{i + 1}: reference audio and its transcript (ref_text) go together")
    if not cloned:
        return processor.build_prompt(text, **fields)
    prefix = ""
    for i in cloned:  # upstream app: "[S1]<transcript 1>[S2]<transcript 2>" + dialogue
        transcript = str(texts[i]).strip()
        prefix += transcript if transcript.startswith(f"[S{i + 1}]") else f"[S{i + 1}] {transcript}"
    prompt_codes = np.concatenate([codes[i] for i in cloned])
    return processor.build_prompt(_merge_speaker_runs(prefix + text), references=codes, prompt_codes=prompt_codes,
                                  **fields)


def _merge_speaker_runs(text: str) -> str:
    """Drop a speaker tag that repeats the previous one ("[S2]a[S2]b" -> "[S2]ab"), as upstream."""
    out, current = [], None
    for part in re.split(r"(?=\[S\d+\])", text):
        m = re.match(r"^(\[S\d+\])\s*(.*)", part, re.DOTALL)
        if m is None:
            out.append(part)
        elif m.group(1) == current:
            out.append(m.group(2))
        else:
            current = m.group(1)
            out.append(m.group(1) + m.group(2))
    return "".join(out)


def build_sound_effect(processor: DelayProcessor, r: DelayRequest) -> np.ndarray:
    description = _required(r.text, "the sound description (input)")
    return processor.build_prompt(None, ambient_sound=description.strip(), tokens=r.tokens)


def build_voice_generator(processor: DelayProcessor, r: DelayRequest) -> np.ndarray:
    text = _required(r.text, "input text")
    instructions = _required(r.instructions, "instructions (a description of the voice to generate)")
    return processor.build_prompt(text, instruction=instructions.strip(), language=r.language, tokens=r.tokens)


# the optional job fields each variant's adapter reads; the variant clears the rest
USED_FIELDS: dict[str, frozenset[OptionalField]] = {
    "moss-tts": frozenset({"reference", "ref_text", "instructions", "language"}),
    "ttsd": frozenset({"reference", "ref_text", "language"}),
    "sound-effect": frozenset(),
    "voice-generator": frozenset({"instructions", "language"}),
}

BUILDERS = {
    "moss-tts": build_moss_tts,
    "ttsd": build_ttsd,
    "sound-effect": build_sound_effect,
    "voice-generator": build_voice_generator,
}


def variant_for_config(config: dict, name: str | None = None) -> str:
    """The Delay variant serving `config`: `name` when given, else moss-tts for n_vq 32."""
    if name is not None:
        if name not in BUILDERS:
            raise ValueError(f"unknown Delay variant {name!r}; choose one of {sorted(BUILDERS)}")
        return name
    if int(config.get("n_vq", 32)) == 32:
        return "moss-tts"
    raise ValueError("a 16-codebook Delay checkpoint may be TTSD, SoundEffect or VoiceGenerator: "
                     f"name the variant explicitly (one of {sorted(BUILDERS)})")


def build_request(processor: DelayProcessor, variant: str, request: DelayRequest) -> np.ndarray:
    """The prompt `[S, 1 + n_vq]` for `request` under `variant`'s rules; AdapterError if it breaks one."""
    try:
        return BUILDERS[variant](processor, request)
    except AdapterError:
        raise
    except ValueError as e:  # bad codes shape/values from the processor
        raise AdapterError(str(e)) from None
