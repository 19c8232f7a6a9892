"""Text that arrives in pieces, cut into speakable segments (sentences or clauses).

`Segmenter.push(text)` buffers text and returns the segments completed so far; `flush()` returns
what is left. Where a segment ends depends only on the text, never on how it was split into
pieces: a boundary is decided only once the character after it has arrived (or at `flush`), so
the same text sent whole or a few characters at a time gives the same segments.

Rules (English and Chinese at least):
- sentence ends: `. ! ? …` followed by whitespace and a word that does not start in lowercase
  (so "3.14", "e.g. this" and `"Done?" she asked` do not end one), and the full-width
  `。 ！ ？ ．` (no space needed); closing quotes and brackets right after the mark stay with the
  sentence; a line break ends one too.
- clause ends (granularity "clause", in addition): `, ; :` followed by whitespace, and the
  full-width `， ； ： 、`.
- a segment shorter than `min_chars` (stripped) is not cut off: it joins the next one, so one
  word ("Yes.") is not an utterance of its own; "Mr." / "Dr." and single initials ("J.") never
  end a sentence.
- a segment that grows past `max_chars` without a boundary is cut at its last whitespace before
  the limit (or at the limit).
- granularity "none": no cuts but that one; everything up to `flush` is one segment unless it
  grows past `max_chars` (no segment is ever longer than a speech request may be).
"""

from __future__ import annotations

from typing import Literal

Granularity = Literal["none", "sentence", "clause"]

SENTENCE_MARKS = frozenset(".!?…")        # need whitespace after them
WIDE_SENTENCE_MARKS = frozenset("。！？．")  # end a sentence on their own
CLAUSE_MARKS = frozenset(",;:")
WIDE_CLAUSE_MARKS = frozenset("，；：、")
CLOSERS = frozenset("\"')]}»”’」』）】》")
ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "e.g", "i.e",
                           "a.m", "p.m", "u.s"})


class Segmenter:
    """One utterance's text buffer; see the module docstring."""

    def __init__(self, granularity: Granularity = "sentence", *, min_chars: int = 10,
                 max_chars: int = 400) -> None:
        if granularity not in ("none", "sentence", "clause"):
            raise ValueError(f"granularity {granularity!r}: expected none, sentence or clause")
        if not 1 <= min_chars <= max_chars:
            raise ValueError(f"need 1 <= min_chars ({min_chars}) <= max_chars ({max_chars})")
        self.granularity = granularity
        self.min_chars = min_chars
        self.max_chars = max_chars
        self._buffer = ""
        self._scanned = 0  # buffer positions before this one hold no undecided boundary

    @property
    def buffered(self) -> str:
        """Text received but not yet part of a returned segment."""
        return self._buffer

    def push(self, text: str) -> list[str]:
        """Add `text`; the segments it completes, in order (stripped, never empty)."""
        self._buffer += text
        out: list[str] = []
        while True:
            cut = self._next_cut()
            if cut is None:
                return out
            segment, self._buffer, self._scanned = self._buffer[:cut].strip(), self._buffer[cut:], 0
            if segment:
                out.append(segment)

    def flush(self) -> str | None:
        """Everything still buffered as the last segment (None when only whitespace is left)."""
        rest, self._buffer, self._scanned = self._buffer.strip(), "", 0
        return rest or None

    def clear(self) -> None:
        """Drop the buffered text."""
        self._buffer, self._scanned = "", 0

    # ---- boundaries ----------------------------------------------------------------------------

    def _next_cut(self) -> int | None:
        """End of the first complete segment in the buffer, or None while it is undecided."""
        text = self._buffer
        i = self._scanned
        while i < len(text):
            if i >= self.max_chars:
                return self._forced_cut(text)
            end = self._boundary_end(text, i)
            if end is None:  # undecided: wait for the next character
                self._scanned = i
                return None
            if end and len(text[:end].strip()) >= self.min_chars:
                return end
            i = max(i + 1, end)
        self._scanned = i
        return None

    def _forced_cut(self, text: str) -> int:
        space = text.rfind(" ", 0, self.max_chars)
        return space + 1 if space > 0 else self.max_chars

    def _boundary_end(self, text: str, i: int) -> int | None:
        """If a segment ends with the mark at `i`: where the segment ends (past closers and
        whitespace); 0 when `i` is no boundary; None when the next character is still to come."""
        if self.granularity == "none":
            return 0
        c = text[i]
        if c == "\n":
            return i + 1
        wide = c in WIDE_SENTENCE_MARKS or (self.granularity == "clause" and c in WIDE_CLAUSE_MARKS)
        narrow = c in SENTENCE_MARKS or (self.granularity == "clause" and c in CLAUSE_MARKS)
        if not (wide or narrow):
            return 0
        j = i + 1
        while j < len(text) and text[j] in CLOSERS:
            j += 1
        if j == len(text):
            return None  # a closer or the confirming whitespace may still come
        if wide:
            return j
        if not text[j].isspace():
            return 0
        if c in CLAUSE_MARKS:
            return j
        k = j
        while k < len(text) and text[k].isspace():
            k += 1
        if k == len(text):
            return None  # the next word tells: a lowercase one continues the sentence
        if text[k].islower() or (c == "." and _abbreviation_before(text, i)):
            return 0
        return j


def _abbreviation_before(text: str, i: int) -> bool:
    """Whether the "." at `i` ends a known abbreviation or a single initial."""
    start = i
    while start > 0 and (text[start - 1].isalpha() or text[start - 1] == "."):
        start -= 1
    word = text[start:i].lower()
    initial = len(word) == 1 and word != "i" and text[start:i].isupper()
    return word in ABBREVIATIONS or initial
