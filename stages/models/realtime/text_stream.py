"""MOSS-TTS-Realtime's text while it speaks: text pieces in, the request and its text rows out.

Upstream's streaming session tokenizes text as it arrives and starts the model once 12 text
tokens are there (the prefill, docs/model_facts.md "Realtime"), then feeds one token per frame. Here:
- `push(text)` tokenizes the longest prefix whose tokens no later text can change (`stable_cut`),
  so the ids equal those of the whole text tokenized at once, however it was split;
- `request()` is the request to submit once 12 tokens are there (or the text has ended): the
  prompt of `RealtimeProcessor.prompt_of_ids`, every token so far in it;
- `take_rows()` gives the tokens released since, as rows for the runner (`Feed` records);
- `end()` tokenizes the rest; `forced_frames()` is the forced length of the whole text.
"""

from __future__ import annotations

import dataclasses
import unicodedata

import numpy as np

from speech.job import SpeechJob
from stages.models.realtime.config import PREFILL_TEXT_TOKENS
from stages.variant import TalkerRequest


def stable_cut(text: str, start: int = 1) -> int:
    """Length of the longest prefix of `text` whose tokens cannot change whatever follows: up to
    the last letter or digit that whitespace or punctuation follows. Qwen's byte-level BPE
    pre-tokenizer (the regex of `tokenizer.json`) always has a piece boundary there, and a piece
    that starts there reads only what follows it, so the prefix tokenized alone gives the same
    ids as inside the whole text. A combining mark (category M) is no boundary: it may compose.
    Only cuts at `start` or later are looked for (text before it is known to hold none), so
    text arriving a character at a time costs linear time, not quadratic."""
    for i in range(len(text) - 1, max(start, 1) - 1, -1):
        if text[i - 1].isalnum() and (text[i].isspace() or unicodedata.category(text[i])[0] in "PS"):
            return i
    return 0


class RealtimeTextStream:
    """One request's text as it arrives (`stages.variant.TextStream`)."""

    def __init__(self, variant, job: SpeechJob) -> None:
        self._variant, self._job = variant, job
        self._processor = variant.processor
        self._untokenized = ""      # text after the last stable cut
        self._ids: list[int] = []   # tokenized, not yet in the request or a feed
        self._started = False
        self.text = ""              # everything received
        self.ended = False

    def push(self, text: str) -> None:
        self.text += text
        known = len(self._untokenized)  # no cut in it: the last push cut off every one
        self._untokenized += text
        cut = stable_cut(self._untokenized, start=max(1, known))
        if cut:
            self._ids += self._processor.tokenizer.encode(self._untokenized[:cut])
            self._untokenized = self._untokenized[cut:]

    def end(self) -> None:
        self.ended = True
        if self._untokenized:
            self._ids += self._processor.tokenizer.encode(self._untokenized)
            self._untokenized = ""

    def request(self) -> TalkerRequest | None:
        """The request to submit, once (None before there is enough text, and after)."""
        if self._started or not (len(self._ids) >= PREFILL_TEXT_TOKENS or (self.ended and self._ids)):
            return None
        self._started = True
        prompt = self._processor.prompt_of_ids(self._ids, reference=self._job.ref_codes)
        self._ids = []
        return TalkerRequest(prompt, self._variant.resolve_sampling(self._whole_job()))

    def take_rows(self) -> np.ndarray:
        """Text rows `[n, 17]` released since the request or the last call (n may be 0)."""
        width = 1 + self._processor.config.rvq
        rows = self._processor.text_rows(self._ids) if self._ids else np.zeros((0, width), dtype=np.int64)
        self._ids = []
        return rows

    def forced_frames(self) -> int | None:
        """The forced length of the text received so far (None when lengths are not forced)."""
        job = self._whole_job()
        if job.forced_frames is None and not self._variant.profile.model.force_length_from_text:
            return None
        return self._variant.resolve_sampling(job).forced_frames

    def _whole_job(self) -> SpeechJob:
        return dataclasses.replace(self._job, text=self.text)
