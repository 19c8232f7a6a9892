"""Prompt processor of MOSS-TTS-Local-Transformer-v1.5: request fields -> 2-D prompt `[S, 1 + n_vq]`.

Column 0 is the text channel, columns 1..n_vq the audio codes (the pad code on text rows).
Three layouts, as the upstream processor builds them (docs/models.md, "Local-v1.5" and "Golden fixtures"):

* plain:        user turn with reference "None", then `<|im_start|>assistant\\n<|audio_start|>`.
* voice clone:  the reference rows `audio_start, user_slot * T, audio_end` stand directly after
                "- Reference(s):\\n" (no `[S1]:` label); each row carries that frame's codes.
* continuation: user turn with reference "None" and `text = prompt_text + target_text`, then
                `audio_start` and the prompt audio rows on the *assistant* slot id, no audio_end:
                generation resumes inside the audio block.

Upstream tokenizes the pieces (role prefix, template prefix, "None", the field block, the text,
the assistant prefix) one by one and concatenates the ids; tokenizing the joined string gives
different ids at the seams, so this module does the same. Special ids come from `config.json`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stages.runtime.checkpoint import read_config
from stages.models.local_v15.config import LocalV15Config
from stages.runtime.tokenizer import TextTokenizer

USER_ROLE_PREFIX = "user\n"
REFERENCE_PREFIX = "<user_inst>\n- Reference(s):\n"
NO_REFERENCE = "None"
USER_TEMPLATE_SUFFIX = "\n</user_inst>"
ASSISTANT_TURN_PREFIX = "\n"
ASSISTANT_ROLE_PREFIX = "assistant\n"


@dataclass(frozen=True)
class PromptIds:
    """The special ids and sizes a v1.5 prompt needs, read from the talker's config.json."""

    n_vq: int
    audio_pad_code: int
    pad_token_id: int
    im_start: int
    im_end: int
    audio_start: int
    audio_end: int
    user_slot: int
    assistant_slot: int

    @classmethod
    def from_config(cls, config: dict) -> PromptIds:
        """The prompt's ids as the talker config reads them (one parser for both)."""
        cfg = LocalV15Config.from_dict(config)
        return cls(
            n_vq=cfg.n_vq,
            audio_pad_code=cfg.audio_pad_code,
            pad_token_id=cfg.pad_token_id,
            im_start=cfg.im_start,
            im_end=cfg.im_end,
            audio_start=cfg.audio_start,
            audio_end=cfg.audio_end,
            user_slot=cfg.user_slot,
            assistant_slot=cfg.gen_slot,
        )


def _field(value: object) -> str:
    """Upstream template value: None or blank -> "None", else the stripped string."""
    if value is None:
        return "None"
    text = str(value).strip()
    return text or "None"


def render_fields_after_reference(
    *,
    instruction: object = None,
    tokens: object = None,
    quality: object = None,
    sound_event: object = None,
    ambient_sound: object = None,
    language: object = None,
) -> str:
    """The template block between the reference and the text, ending in "- Text:\\n"."""
    return (
        "\n- Instruction:\n" + _field(instruction)
        + "\n- Tokens:\n" + _field(tokens)
        + "\n- Quality:\n" + _field(quality)
        + "\n- Sound Event:\n" + _field(sound_event)
        + "\n- Ambient Sound:\n" + _field(ambient_sound)
        + "\n- Language:\n" + _field(language)
        + "\n- Text:\n"
    )


class LocalV15Processor:
    """Builds v1.5 prompts from text, optional reference codes and the template fields."""

    def __init__(self, tokenizer: TextTokenizer, ids: PromptIds) -> None:
        self.tokenizer = tokenizer
        self.ids = ids

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> LocalV15Processor:
        return cls(TextTokenizer.from_dir(model_dir), PromptIds.from_config(read_config(model_dir)))

    # ---- rows ----------------------------------------------------------------------------------

    def _text_rows(self, token_ids: Sequence[int]) -> np.ndarray:
        rows = np.full((len(token_ids), self.ids.n_vq + 1), self.ids.audio_pad_code, dtype=np.int64)  # [n, 1+n_vq]
        rows[:, 0] = np.asarray(token_ids, dtype=np.int64)
        return rows

    def _audio_rows(self, codes: np.ndarray, slot_id: int) -> np.ndarray:
        codes = self._check_codes(codes)  # [T, n_vq]
        rows = np.empty((codes.shape[0], self.ids.n_vq + 1), dtype=np.int64)  # [T, 1+n_vq]
        rows[:, 0] = slot_id
        rows[:, 1:] = codes
        return rows

    def _check_codes(self, codes: np.ndarray) -> np.ndarray:
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != self.ids.n_vq:
            raise ValueError(f"audio codes must have shape [T, {self.ids.n_vq}], got {tuple(codes.shape)}")
        return codes.astype(np.int64, copy=False)

    # ---- id pieces -----------------------------------------------------------------------------

    def _user_prefix_ids(self) -> list[int]:
        enc = self.tokenizer.encode
        return [self.ids.im_start] + enc(USER_ROLE_PREFIX) + enc(REFERENCE_PREFIX)

    def _assistant_prefix_ids(self) -> list[int]:
        enc = self.tokenizer.encode
        return (
            enc(USER_TEMPLATE_SUFFIX) + [self.ids.im_end] + enc(ASSISTANT_TURN_PREFIX)
            + [self.ids.im_start] + enc(ASSISTANT_ROLE_PREFIX) + [self.ids.audio_start]
        )

    # ---- prompts -------------------------------------------------------------------------------

    def build_prompt(
        self,
        text: str | None,
        *,
        reference: Sequence[np.ndarray] = (),
        prompt_codes: np.ndarray | None = None,
        prompt_text: str | None = None,
        language: str | None = None,
        tokens: int | None = None,
        instruction: str | None = None,
        quality: str | None = None,
        sound_event: str | None = None,
        ambient_sound: str | None = None,
    ) -> np.ndarray:
        """One prompt `[S, 1 + n_vq]` int64.

        reference:    voice-clone reference codes, each `[T, n_vq]` (one block per item).
        prompt_codes: continuation prefix `[T, n_vq]` (the reference clip's codes); its
                      transcript `prompt_text` is prepended to `text`.
        tokens:       target length in frames (12.5 per second), written into the template.
        """
        if prompt_codes is not None and len(reference) > 0:
            raise ValueError("continuation (prompt_codes) and voice-clone references cannot be combined")
        if prompt_codes is None and prompt_text:
            raise ValueError("prompt_text needs prompt_codes (the reference clip's codes)")
        target = "" if text is None else str(text)
        fields = render_fields_after_reference(
            instruction=instruction, tokens=tokens, quality=quality, sound_event=sound_event,
            ambient_sound=ambient_sound, language=language,
        )
        enc = self.tokenizer.encode
        if prompt_codes is not None:
            full_text = (prompt_text or "") + target
            head = self._user_prefix_ids() + enc(NO_REFERENCE) + enc(fields) + enc(full_text)
            return np.concatenate([
                self._text_rows(head + self._assistant_prefix_ids()),
                self._audio_rows(prompt_codes, self.ids.assistant_slot),
            ])
        if len(reference) == 0:
            ids = self._user_prefix_ids() + enc(NO_REFERENCE) + enc(fields) + enc(target) + self._assistant_prefix_ids()
            return self._text_rows(ids)
        parts = [self._text_rows(self._user_prefix_ids())]
        for codes in reference:
            parts.append(self._text_rows([self.ids.audio_start]))
            parts.append(self._audio_rows(codes, self.ids.user_slot))
            parts.append(self._text_rows([self.ids.audio_end]))
        parts.append(self._text_rows(enc(fields) + enc(target) + self._assistant_prefix_ids()))
        return np.concatenate(parts)

    def pad_batch(self, prompts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Left-pad prompts to one batch: (`input_ids` [B, S, 1+n_vq], `attention_mask` [B, S] bool).

        Pad rows carry `pad_token_id` in the text channel and the audio pad code elsewhere.
        """
        length = max(p.shape[0] for p in prompts)
        ids = np.full((len(prompts), length, self.ids.n_vq + 1), self.ids.audio_pad_code, dtype=np.int64)
        ids[:, :, 0] = self.ids.pad_token_id
        mask = np.zeros((len(prompts), length), dtype=bool)
        for i, prompt in enumerate(prompts):
            ids[i, length - prompt.shape[0]:] = prompt
            mask[i, length - prompt.shape[0]:] = True
        return ids, mask
