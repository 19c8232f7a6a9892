"""Prompt processor of MOSS-TTS-Realtime (docs/model_facts.md, "Realtime"): system block, optional voice context,
assistant prefix, then the text stream.

`build_prompt` returns one array `[S, 1 + 16]` that carries the whole request:
* rows up to and including the first with the audio BOS (1025) in column 1 are the *prefill*:
  the prompt plus the first min(12, len(text)) text tokens, BOS on the last of them
  (upstream `_build_prefill_batch`);
* every later row holds one further text token in column 0 (pad codes elsewhere); the runner
  feeds them one per frame, then `<|text_pad|>` once they run out.
So the runner needs nothing but the array, and the prefill part equals upstream's prefill ids.

The system and context strings are tokenized as upstream does (their `<|im_start|>` /
`<|im_end|>` markers are the tokenizer's special tokens); the reference-audio rows use the
config's `reference_audio_pad` id and carry the reference codes (first 16 codebooks).
"""

from __future__ import annotations


import numpy as np

from stages.models.realtime.config import PREFILL_TEXT_TOKENS, RealtimeConfig
from stages.runtime.prompt import PromptProcessor, text_rows

SYSTEM_PROMPT = (
    "<|im_start|>system\n"
    "You are a highly expressive text-to-speech (TTS) engine developed by Mosi Intelligence. \n"
    "You possess natural language understanding, emotional modeling, and multi-style speech generation "
    "capabilities, allowing you to generate the corresponding speech based on the text given in the assistant."
    "<|im_end|>\n"
)
CONTEXT_PREFIX = "<|im_start|>context\nThe assistant section should be synthesized using the following voice timbre:"
CONTEXT_SUFFIX = "<|im_end|>\n"
ASSISTANT_PREFIX = "<|im_start|>assistant\n"


class RealtimeProcessor(PromptProcessor):
    """Builds Realtime prompts: the prefill rows, then one row per text token still to stream."""

    config_class = RealtimeConfig
    config: RealtimeConfig

    def _rows(self, ids: list[int]) -> np.ndarray:
        return text_rows(ids, self.config.rvq, self.config.audio_pad)  # [n, 17]

    def prompt_rows(self, reference: np.ndarray | None = None) -> np.ndarray:
        """The prompt before any text: system block, optional voice context, `<|im_start|>assistant\\n`."""
        enc = self.tokenizer.encode
        parts = [self._rows(enc(SYSTEM_PROMPT))]
        if reference is not None:
            codes = np.asarray(reference)
            if codes.ndim != 2 or codes.shape[1] < self.config.rvq or codes.shape[0] == 0:
                raise ValueError(f"reference codes must have shape [T>=1, >={self.config.rvq}], got {codes.shape}")
            codes = codes[:, : self.config.rvq].astype(np.int64)
            if codes.min() < 0 or codes.max() >= self.config.audio_pad:
                raise ValueError(f"reference codes must lie in [0, {self.config.audio_pad})")
            ref = self._rows([self.config.reference_audio_pad] * codes.shape[0])
            ref[:, 1:] = codes
            parts += [self._rows(enc(CONTEXT_PREFIX)), ref, self._rows(enc(CONTEXT_SUFFIX))]
        parts.append(self._rows(enc(ASSISTANT_PREFIX)))
        return np.concatenate(parts)

    def text_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError("Realtime needs non-empty text")
        return ids

    def build_prompt(self, text: str, *, reference: np.ndarray | None = None) -> np.ndarray:
        """Prefill rows followed by one row per remaining text token (see module docstring)."""
        return self.prompt_of_ids(self.text_ids(text), reference=reference)

    def prompt_of_ids(self, ids: list[int], *, reference: np.ndarray | None = None) -> np.ndarray:
        """`build_prompt` of text already tokenized (`ids`, at least one)."""
        if not ids:
            raise ValueError("Realtime needs non-empty text")
        rows = self.text_rows(ids)
        n_prefill = min(PREFILL_TEXT_TOKENS, len(rows))
        rows[n_prefill - 1, 1] = self.config.audio_bos
        return np.concatenate([self.prompt_rows(reference), rows])

    def text_rows(self, ids: list[int]) -> np.ndarray:
        """Rows `[n, 17]` of text tokens still to stream (what `Feed` records carry)."""
        return self._rows(ids)


def split_prompt(prompt: np.ndarray, audio_bos: int) -> tuple[np.ndarray, list[int]]:
    """A built prompt -> (prefill rows [P, 17], the text ids still to stream)."""
    bos_rows = np.flatnonzero(prompt[:, 1] == audio_bos)
    if bos_rows.size == 0:
        raise ValueError("Realtime prompt has no audio BOS row (build it with RealtimeProcessor.build_prompt)")
    end = int(bos_rows[0]) + 1
    return prompt[:end], [int(t) for t in prompt[end:, 0]]
