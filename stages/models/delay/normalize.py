"""Robustness clean-up of TTS input text for the Delay processor (upstream `normalize_tts_text`).

Upstream's `build_user_message` passes the text through a punctuation/whitespace normaliser that
does *no* semantic normalisation (numbers, dates and units stay as written). This is our own
implementation of the same intent, covering the rules that change typical input:

* drop control and zero-width characters; CR/LF and ideographic spaces become plain ones;
* Markdown: `[text](url)` -> `text url`; heading/quote/list markers at line start are removed;
  the remaining non-empty lines are joined with "。" (each line is a sentence);
* whitespace: runs collapse to one space; no spaces between Han/kana characters, nor between
  Han/kana and digits; one space between Han/kana and Latin words; none before `,.;!?` or around
  full-width punctuation;
* flow arrows (`->`, `=>`, `→`, ...) become "，"; long dashes / `--` become "。";
* runs of "..." / "……" become "。"; repeated `!`/`?`/`,`/`。` collapse, mixed `?!` runs -> "？！".

URLs, e-mail addresses, @mentions and #hashtags are shielded from every rule. `[S1]`-style tags
and `{...}` contents are left alone. The function is idempotent on its own output.
"""

from __future__ import annotations

import re
import unicodedata

_CJK = r"[\u3400-\u4dbf\u4e00-\u9fff\u3040-\u30ff]"
_SHIELDED = re.compile(
    r"https?://[^\s\u3000，。！？；、）】》〉」』]+"  # URLs
    r"|[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}"  # e-mail
    r"|(?<![A-Za-z0-9_])[@#][A-Za-z0-9_]+"  # @mention, #hashtag
)
_ZERO_WIDTH = re.compile(r"[\u200b-\u200d\ufeff]")
_LINE_MARKER = re.compile(r"^(?:#{1,6}\s+|>\s+|[-*+]\s+|\d+[.)]\s+)")
_MD_LINK = re.compile(r"\[([^\[\]]+?)\]\((https?://[^)\s]+)\)")
_ARROW = re.compile(r"\s*(?:<[-=]+>|[-=]+>|<[-=]+|[→←↔⇒⇐⇔⟶⟵⟷⟹⟸⟺↦↤↪↩])\s*")
_LONG_DASH = re.compile(r"\s*(?:—|–|―|-){2,}\s*")


def _shield(text: str) -> tuple[str, list[str]]:
    kept: list[str] = []

    def keep(m: re.Match[str]) -> str:
        kept.append(m.group(0))
        return f"\x00{len(kept) - 1}\x00"

    return _SHIELDED.sub(keep, text), kept


def _unshield(text: str, kept: list[str]) -> str:
    return re.sub(r"\x00(\d+)\x00", lambda m: kept[int(m.group(1))], text)


def _clean_characters(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u3000", " ")
    text = _ZERO_WIDTH.sub("", text)
    return "".join(ch for ch in text if ch in "\n\t " or not unicodedata.category(ch).startswith("C"))


def _join_lines(text: str) -> str:
    text = _MD_LINK.sub(r"\1 \2", text)
    lines = [_LINE_MARKER.sub("", line.strip()) for line in text.split("\n")]
    return "。".join(line for line in lines if line)


def _spaces(text: str) -> str:
    latin = r"(?:\x00\d+\x00|[A-Za-z][A-Za-z0-9._/+:-]*)"
    text = re.sub(r"[ \t\f\v]+", " ", text)
    text = re.sub(rf"({_CJK}) (?={_CJK}|\d)", r"\1", text)
    text = re.sub(rf"(\d) (?={_CJK})", r"\1", text)
    text = re.sub(rf"({_CJK})(?={latin})", r"\1 ", text)
    text = re.sub(rf"({latin})(?={_CJK})", r"\1 ", text)
    text = re.sub(r" ?([，。！？；：、”’」』】）》]) ?", r"\1", text)
    text = re.sub(r"([（【「『《“‘]) ", r"\1", text)
    text = re.sub(r" +([,.;!?])", r"\1", text)
    return re.sub(r" {2,}", " ", text).strip()


def _punctuation(text: str) -> str:
    text = _ARROW.sub("，", text)
    text = _LONG_DASH.sub("。", text)
    text = re.sub(r"\.{3,}|…+", "。", text)
    text = re.sub(r"[。．]{2,}", "。", text)
    text = re.sub(r"[，,]{2,}", "，", text)

    def question_exclamation(m: re.Match[str]) -> str:
        run = m.group(0)
        has_q, has_e = any(c in run for c in "?？"), any(c in run for c in "!！")
        return "？！" if has_q and has_e else ("？" if has_q else "！")

    return re.sub(r"[!?！？]{2,}", question_exclamation, text)


def normalize_tts_text(text: str) -> str:
    """Clean `text` for synthesis without changing what is said (see module docstring)."""
    text = _join_lines(_clean_characters(text))
    text, kept = _shield(text)
    text = _spaces(_punctuation(_spaces(text)))
    return _unshield(text, kept).strip()
