"""normalize_tts_text: the robustness rules change punctuation and spacing, never the words."""

import pytest

from stages.models.delay.normalize import normalize_tts_text

CASES = [
    ("Hello world, this is a tiny golden test.", "Hello world, this is a tiny golden test."),
    ("This   is   a   test .", "This is a test."),
    ("这 是\u3000一 段  文本。", "这是一段文本。"),
    ("这是Anthropic的npm包", "这是 Anthropic 的 npm 包"),
    ("A->B => C", "A，B，C"),
    ("真的假的？？？！！！", "真的假的？！"),
    ("wait......ok!!!", "wait。ok！"),
    ("# Title\n- item one\n2. item two", "Title。item one。item two"),
    ("see https://x.com/a--b now", "see https://x.com/a--b now"),
    ("mail ops+tts@example.ai --- ok", "mail ops+tts@example.ai。ok"),
    ("[S1]你好。[S2]收到。", "[S1]你好。[S2]收到。"),
    ("今天 20:00 维护——预计 30 分钟。", "今天20:00维护。预计30分钟。"),
    ("zero\u200bwidth\x07 text", "zerowidth text"),
]


@pytest.mark.parametrize("raw,want", CASES)
def test_rules_and_idempotence(raw, want):
    got = normalize_tts_text(raw)
    assert got == want
    assert normalize_tts_text(got) == got
