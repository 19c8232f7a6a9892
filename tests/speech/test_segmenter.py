"""The segmenter cuts text into sentences or clauses the same way however the text arrives."""

from __future__ import annotations

import random
import re

import pytest

from speech.segmenter import Segmenter

STORY = ("Dr. Smith arrived at 3.14 p.m. today. \"Is it done?\" she asked! Nobody knew, so we waited; "
         "then J. K. Rowling called. Yes. It rained all day long\nand the roof held. "
         "你好，世界。今天天气很好！我们出去走走吧？好。")


def segments(text: str, granularity: str, pieces: list[int] | None = None, **kw) -> list[str]:
    seg = Segmenter(granularity, **kw)
    out: list[str] = []
    if pieces is None:
        out += seg.push(text)
    else:
        at = 0
        for size in pieces:
            out += seg.push(text[at:at + size])
            at += size
        out += seg.push(text[at:])
    rest = seg.flush()
    return out + ([rest] if rest else [])


def test_sentences_in_english_and_chinese():
    assert segments(STORY, "sentence") == [
        "Dr. Smith arrived at 3.14 p.m. today.",
        "\"Is it done?\" she asked!",
        "Nobody knew, so we waited; then J. K. Rowling called.",
        "Yes. It rained all day long",  # "Yes." alone is too short: it joins the next one
        "and the roof held.",
        "你好，世界。今天天气很好！",  # "你好，世界。" is 6 characters: it joins the next one
        "我们出去走走吧？好。",
    ]


def test_clauses_cut_at_commas_and_semicolons_too():
    got = segments(STORY, "clause", min_chars=4)
    assert "Nobody knew," in got and "so we waited;" in got
    assert "你好，世界。" in got and "今天天气很好！" in got


def test_none_keeps_everything_until_the_flush():
    assert segments(STORY, "none") == [STORY.strip()]


def test_none_still_cuts_a_text_longer_than_the_maximum():
    text = "A very long answer, with no end in sight; " * 5
    got = segments(text, "none", max_chars=100)
    assert len(got) > 1 and all(len(s) <= 100 for s in got) and " ".join(got).split() == text.split()
    rng = random.Random(4)
    assert segments(text, "none", [rng.randint(1, 5) for _ in text], max_chars=100) == got


@pytest.mark.parametrize("granularity", ["sentence", "clause", "none"])
def test_pieces_of_one_to_five_characters_give_the_same_segments(granularity):
    whole = segments(STORY, granularity)
    rng = random.Random(7)
    for _ in range(20):
        pieces = [rng.randint(1, 5) for _ in range(len(STORY))]
        assert segments(STORY, granularity, pieces) == whole


def test_a_mark_at_the_end_waits_for_the_next_character():
    seg = Segmenter("sentence")
    assert seg.push("This is the first sentence.") == []  # "." may be "3.14" or "e.g.": undecided
    assert seg.push(" And") == ["This is the first sentence."]
    assert seg.buffered == " And"
    seg = Segmenter("sentence", min_chars=2)
    assert seg.push("好的。") == []  # a closing quote may still follow
    assert seg.push("」后来") == ["好的。」"]


def test_a_long_run_without_a_boundary_is_cut_at_a_space():
    text = "word " * 30
    got = segments(text, "sentence", max_chars=42)
    assert all(len(s) <= 42 for s in got) and " ".join(got).split() == text.split()
    rng = random.Random(3)
    assert segments(text, "sentence", [rng.randint(1, 5) for _ in text], max_chars=42) == got


def test_clear_drops_the_buffer():
    seg = Segmenter()
    seg.push("half a sent")
    seg.clear()
    assert seg.buffered == "" and seg.flush() is None


def documented_examples() -> list[tuple[list[str], str, list[str], list[str]]]:
    """The rows of docs/interfaces.md's table of where a sentence ends: (pieces, granularity,
    segments before input.done, segments at it). A cell's code spans are its strings."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "interfaces.md").read_text()
    table = doc.split("**Where a sentence ends**", 1)[1]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 4 or cells[1] not in ("sentence", "clause", "none"):
            continue
        spans = [re.findall(r"``(.+?)``|`([^`]+)`", cell) for cell in cells]
        strings = [[a or b for a, b in found] for found in spans]
        before = strings[2][:1] if strings[2] else []  # "(when ` H` arrives)" is a comment
        rows.append((strings[0], cells[1], before, strings[3]))
    return rows


def test_the_documented_examples_are_what_the_segmenter_does() -> None:
    rows = documented_examples()
    assert len(rows) >= 8
    for pieces, granularity, before, at_done in rows:
        seg = Segmenter(granularity)  # the profile's default bounds (stream.*): 10 and 400
        spoken = [s for piece in pieces for s in seg.push(piece)]
        assert spoken == before, (pieces, spoken)
        rest = seg.flush()
        assert ([rest] if rest else []) == at_done, (pieces, rest)
