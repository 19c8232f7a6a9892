"""Prompt processor of the Delay talker: request fields -> 2-D prompt `[S, 1 + n_vq]`
(docs/model_facts.md, "Delay family").

Column 0 is the text stream, columns 1..n_vq the audio codes in the *delayed* layout (pad code
everywhere but inside audio blocks). Upstream renders a chat-formatted string per message
(`<|im_start|>{role}\\n{content}<|im_end|>\\n`, plus `<|im_start|>assistant\\n` after the last user
message in generation mode), expands each `<|audio|>` placeholder into an audio block and
tokenizes the string. Special tokens split the string before BPE, so tokenizing the text between
them piece by piece gives the same ids; this module does that and takes every special id from
`config.json`, never from token strings.

Audio blocks (T frames, delayed to T + n_vq - 1 rows; the start/end rows carry pad codes):
* user (references):   audio_start, user_slot x (T + n_vq - 1), audio_end
* assistant (prefix):  audio_start, gen_slot x T, delay_slot x (n_vq - 1), audio_end
Continuation mode cuts the assistant block after its T-th gen-slot row, so generation resumes
inside audio and the model completes the missing higher codebooks of the last frames.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stages.models.delay.config import DelayConfig
from stages.models.delay.delay_pattern import apply_delay_pattern
from stages.models.delay.normalize import normalize_tts_text
from stages.runtime.prompt import PromptProcessor, text_rows

FIELD_ORDER = ("instruction", "tokens", "quality", "sound_event", "ambient_sound", "language")
FIELD_TITLES = {
    "instruction": "Instruction", "tokens": "Tokens", "quality": "Quality",
    "sound_event": "Sound Event", "ambient_sound": "Ambient Sound", "language": "Language",
}

# A piece of a prompt: text to tokenize, one special id, or ready-made rows [n, 1 + n_vq].
Piece = str | int | np.ndarray


class DelayProcessor(PromptProcessor):
    """Builds Delay prompts (generation and continuation) from text, references and template fields."""

    config_class = DelayConfig
    config: DelayConfig

    # ---- rows ----------------------------------------------------------------------------------

    def _text_rows(self, ids: Sequence[int]) -> np.ndarray:
        return text_rows(ids, self.config.n_vq, self.config.audio_pad_code)

    def check_codes(self, codes: np.ndarray) -> np.ndarray:
        """Validate audio codes `[T, n_vq]` (T >= 1, values in the codebook) and return them as int64."""
        codes = np.asarray(codes)
        n_vq = self.config.n_vq
        if codes.ndim != 2 or codes.shape[1] != n_vq or codes.shape[0] == 0:
            raise ValueError(f"audio codes must have shape [T>=1, {n_vq}], got {tuple(codes.shape)}")
        if codes.min() < 0 or codes.max() >= self.config.audio_vocab_size:
            raise ValueError(f"audio codes must lie in [0, {self.config.audio_vocab_size})")
        return codes.astype(np.int64, copy=False)

    def audio_block(self, codes: np.ndarray, role: str) -> np.ndarray:
        """The rows of one audio block (see module docstring) for `role` "user" or "assistant"."""
        cfg = self.config
        codes = self.check_codes(codes)
        t = codes.shape[0]
        delayed = apply_delay_pattern(codes, cfg.audio_pad_code)  # [T + n_vq - 1, n_vq]
        body = np.empty((delayed.shape[0], cfg.n_vq + 1), dtype=np.int64)
        body[:, 1:] = delayed
        if role == "user":
            body[:, 0] = cfg.user_slot
        else:
            body[:t, 0] = cfg.gen_slot
            body[t:, 0] = cfg.delay_slot
        return np.concatenate([self._text_rows([cfg.audio_start]), body, self._text_rows([cfg.audio_end])])

    def _assemble(self, pieces: Sequence[Piece]) -> np.ndarray:
        """Tokenize runs of text, keep special ids and row blocks, concatenate in order."""
        parts: list[np.ndarray] = []
        text = ""
        for piece in pieces:
            if isinstance(piece, str):
                text += piece
                continue
            if text:
                parts.append(self._text_rows(self.tokenizer.encode(text)))
                text = ""
            parts.append(self._text_rows([piece]) if isinstance(piece, int) else piece)
        if text:
            parts.append(self._text_rows(self.tokenizer.encode(text)))
        return np.concatenate(parts)

    # ---- messages ------------------------------------------------------------------------------

    def user_pieces(
        self,
        text: str | None,
        references: Sequence[np.ndarray | None] = (),
        *,
        normalize: bool = True,
        **fields: object,
    ) -> list[Piece]:
        """The user turn's content: the upstream template with one `[S{i}]:` block per reference.

        `references[i]` belongs to speaker S{i+1}; None entries keep their number but add no block.
        Fields (instruction, tokens, quality, sound_event, ambient_sound, language) render as
        `str(value)`, so an absent field is the literal "None", exactly as upstream.
        """
        unknown = set(fields) - set(FIELD_ORDER)
        if unknown:
            raise TypeError(f"unknown prompt fields: {sorted(unknown)}")
        if text is not None and normalize:
            text = normalize_tts_text(text)
        pieces: list[Piece] = ["<user_inst>\n- Reference(s):\n"]
        blocks = [(i, codes) for i, codes in enumerate(references) if codes is not None]
        if not blocks:
            pieces.append("None")
        for n, (i, codes) in enumerate(blocks):
            pieces.append(("\n" if n else "") + f"[S{i + 1}]:\n")
            pieces.append(self.audio_block(codes, "user"))
        for name in FIELD_ORDER:
            pieces.append(f"\n- {FIELD_TITLES[name]}:\n{fields.get(name)}")
        pieces.append(f"\n- Text:\n{text}\n</user_inst>")
        return pieces

    def build_prompt(
        self,
        text: str | None,
        *,
        references: Sequence[np.ndarray | None] = (),
        prompt_codes: np.ndarray | None = None,
        normalize: bool = True,
        **fields: object,
    ) -> np.ndarray:
        """One prompt `[S, 1 + n_vq]` int64.

        Generation mode: user turn, then `<|im_start|>assistant\\n`; the model opens audio itself.
        Continuation (`prompt_codes` [T, n_vq] given): user turn, then an assistant turn holding
        the prompt audio, cut after its T-th gen-slot row. For reference-transcript cloning the
        caller puts the transcript in front of the target text (upstream does the same).
        """
        cfg = self.config
        user = self.user_pieces(text, references, normalize=normalize, **fields)
        pieces: list[Piece] = [cfg.im_start, "user\n", *user, cfg.im_end, "\n", cfg.im_start, "assistant\n"]
        if prompt_codes is None:
            return self._assemble(pieces)
        block = self.audio_block(prompt_codes, "assistant")
        t = self.check_codes(prompt_codes).shape[0]
        return self._assemble([*pieces, block[: 1 + t]])

    def pad_batch(self, prompts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Left-pad prompts as upstream `_pad`: (`input_ids` [B, S, 1+n_vq], `attention_mask` [B, S])."""
        cfg = self.config
        length = max(p.shape[0] for p in prompts)
        ids = np.full((len(prompts), length, cfg.n_vq + 1), cfg.audio_pad_code, dtype=np.int64)
        ids[:, :, 0] = cfg.pad_token_id
        mask = np.zeros((len(prompts), length), dtype=bool)
        for i, prompt in enumerate(prompts):
            ids[i, length - prompt.shape[0]:] = prompt
            mask[i, length - prompt.shape[0]:] = True
        return ids, mask
