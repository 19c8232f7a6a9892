"""Prompt processor of MOSS-TTS-Local-Transformer-v1.5: request fields -> 2-D prompt `[S, 1 + n_vq]`.

Column 0 is the text channel, columns 1..n_vq the audio codes (the pad code on text rows).
Three layouts, as the upstream processor builds them (docs/model_facts.md, "Local-v1.5" and "Golden fixtures"):

* plain:        user turn with reference "None", then `<|im_start|>assistant\\n<|audio_start|>`.
* voice clone:  the reference rows `audio_start, user_slot * T, audio_end` stand directly after
                "- Reference(s):\\n" (no `[S1]:` label); each row carries that frame's codes.
* continuation: user turn with reference "None" and `text = prompt_text + target_text`, then
                `audio_start` and the prompt audio rows on the *assistant* slot id, no audio_end:
                generation resumes inside the audio block.
* both:         the voice-clone user turn (reference rows) with `text = prompt_text +
                target_text`, then the continuation's assistant rows: what upstream's processor
                builds from a user message with a reference followed by an assistant audio
                message (its generic path; its direct path has no reference slot in
                continuation). A stream's later sentences use it: same voice reference, the
                previous sentence as the continuation prompt.

Upstream tokenizes the pieces (role prefix, template prefix, "None", the field block, the text,
the assistant prefix) one by one and concatenates the ids; tokenizing the joined string gives
different ids at the seams, so this module does the same. Special ids come from `config.json`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stages.models.local_v15.config import LocalV15Config
from stages.runtime.prompt import PromptProcessor, text_rows

USER_ROLE_PREFIX = "user\n"
REFERENCE_PREFIX = "<user_inst>\n- Reference(s):\n"
NO_REFERENCE = "None"
USER_TEMPLATE_SUFFIX = "\n</user_inst>"
ASSISTANT_TURN_PREFIX = "\n"
ASSISTANT_ROLE_PREFIX = "assistant\n"


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


class LocalV15Processor(PromptProcessor):
    """Builds v1.5 prompts from text, optional reference codes and the template fields."""

    config_class = LocalV15Config
    config: LocalV15Config

    # ---- rows ----------------------------------------------------------------------------------

    def _text_rows(self, token_ids: Sequence[int]) -> np.ndarray:
        return text_rows(token_ids, self.config.n_vq, self.config.audio_pad_code)

    def _audio_rows(self, codes: np.ndarray, slot_id: int) -> np.ndarray:
        codes = self._check_codes(codes)  # [T, n_vq]
        rows = np.empty((codes.shape[0], self.config.n_vq + 1), dtype=np.int64)  # [T, 1+n_vq]
        rows[:, 0] = slot_id
        rows[:, 1:] = codes
        return rows

    def _check_codes(self, codes: np.ndarray) -> np.ndarray:
        codes = np.asarray(codes)
        if codes.ndim != 2 or codes.shape[1] != self.config.n_vq:
            raise ValueError(f"audio codes must have shape [T, {self.config.n_vq}], got {tuple(codes.shape)}")
        return codes.astype(np.int64, copy=False)

    # ---- id pieces -----------------------------------------------------------------------------

    def _user_prefix_ids(self) -> list[int]:
        enc = self.tokenizer.encode
        return [self.config.im_start] + enc(USER_ROLE_PREFIX) + enc(REFERENCE_PREFIX)

    def _assistant_prefix_ids(self) -> list[int]:
        enc = self.tokenizer.encode
        return (
            enc(USER_TEMPLATE_SUFFIX) + [self.config.im_end] + enc(ASSISTANT_TURN_PREFIX)
            + [self.config.im_start] + enc(ASSISTANT_ROLE_PREFIX) + [self.config.audio_start]
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
        prompt_codes: continuation prefix `[T, n_vq]` (the reference clip's codes, or the audio
                      just spoken); its transcript `prompt_text` is prepended to `text`.
        tokens:       target length in frames (12.5 per second), written into the template.
        """
        if prompt_codes is None and prompt_text:
            raise ValueError("prompt_text needs prompt_codes (the reference clip's codes)")
        target = "" if text is None else str(text)
        fields = render_fields_after_reference(
            instruction=instruction, tokens=tokens, quality=quality, sound_event=sound_event,
            ambient_sound=ambient_sound, language=language,
        )
        enc = self.tokenizer.encode
        if prompt_codes is not None and len(reference) > 0:
            user = self.build_prompt((prompt_text or "") + target, reference=reference, language=language,
                                     tokens=tokens, instruction=instruction, quality=quality,
                                     sound_event=sound_event, ambient_sound=ambient_sound)
            return np.concatenate([user, self._audio_rows(prompt_codes, self.config.gen_slot)])
        if prompt_codes is not None:
            full_text = (prompt_text or "") + target
            head = self._user_prefix_ids() + enc(NO_REFERENCE) + enc(fields) + enc(full_text)
            return np.concatenate([
                self._text_rows(head + self._assistant_prefix_ids()),
                self._audio_rows(prompt_codes, self.config.gen_slot),
            ])
        if len(reference) == 0:
            ids = self._user_prefix_ids() + enc(NO_REFERENCE) + enc(fields) + enc(target) + self._assistant_prefix_ids()
            return self._text_rows(ids)
        parts = [self._text_rows(self._user_prefix_ids())]
        for codes in reference:
            parts.append(self._text_rows([self.config.audio_start]))
            parts.append(self._audio_rows(codes, self.config.user_slot))
            parts.append(self._text_rows([self.config.audio_end]))
        parts.append(self._text_rows(enc(fields) + enc(target) + self._assistant_prefix_ids()))
        return np.concatenate(parts)

    def pad_batch(self, prompts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Left-pad prompts to one batch: (`input_ids` [B, S, 1+n_vq], `attention_mask` [B, S] bool).

        Pad rows carry `pad_token_id` in the text channel and the audio pad code elsewhere.
        """
        length = max(p.shape[0] for p in prompts)
        ids = np.full((len(prompts), length, self.config.n_vq + 1), self.config.audio_pad_code, dtype=np.int64)
        ids[:, :, 0] = self.config.pad_token_id
        mask = np.zeros((len(prompts), length), dtype=bool)
        for i, prompt in enumerate(prompts):
            ids[i, length - prompt.shape[0]:] = prompt
            mask[i, length - prompt.shape[0]:] = True
        return ids, mask
