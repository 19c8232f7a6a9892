"""The repository speaks of the product: no document, comment or string counts the work periods
it was built in ("the fifth session", "call 3" of a measurement day), cites an issue number or
says random weights never stop (their stop head fires at random); the history of the figures is
told by what changed (docs/performance-history.md)."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "__pycache__", "golden", "node_modules"}  # golden: upstream's data
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".html", ".cfg", ".ini", ""}

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|"
            r"twentieth|twenty-\w+|thirtieth|thirty-\w+|\d+(?:st|nd|rd|th)")
EVERYWHERE = {
    "a numbered work period": re.compile(rf"\b(?:{ORDINALS}) (?:work )?(?:session|period|sprint)s?\b",
                                         re.IGNORECASE),
    "a session by number": re.compile(r"\bsessions? \d+\b", re.IGNORECASE),
    "an issue by number": re.compile(r"\bissues? ?#?\d+|\(#\d+\)", re.IGNORECASE),
    "the issue as a source": re.compile(r"\bthe issue'?s?\b(?! (?:of|with|is|was|here))", re.IGNORECASE),
    # random weights' stop head fires at random, often at once (the demo model's length is forced)
    "random weights said never to stop": re.compile(r"random weights never (?:decide to )?stop|"
                                                    r"never stops? by (?:it|them)sel(?:f|ves)", re.IGNORECASE),
}
# in prose, a measurement day's runs by number ("call 3", "calls 1-4")
IN_DOCS = {"a measurement call by number": re.compile(r"\bcalls? \d+(?:-\d+)?\b")}


def repository_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.split()
        paths = [REPO / p for p in listed]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file
        paths = [p for p in REPO.rglob("*") if p.is_file()]
    me = Path(__file__).resolve()  # it spells out what it looks for
    return [p for p in paths if not SKIP_DIRS & set(p.relative_to(REPO).parts)
            and p.suffix in TEXT_SUFFIXES and p.is_file() and p.resolve() != me]


def test_no_file_counts_work_periods_or_cites_an_issue() -> None:
    found = []
    for path in repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        rules = {**EVERYWHERE, **(IN_DOCS if path.suffix == ".md" else {})}
        for number, line in enumerate(text.splitlines(), 1):
            for what, pattern in rules.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {what}: {line.strip()[:120]}")
    assert found == [], "\n".join(found[:40])


def test_the_rules_catch_what_they_are_for() -> None:
    caught = ["random weights never stop by themselves", "the twenty-first session's table", "as the fifth session found", "session 12",
              "see issue #123", "(#4804)", "the issue's table", "measured in the 3rd session"]
    fine = ["a WebSocket session", "this session's config", "pytorch#190489", "no host-to-device "
            "copy is issued", "sessions per API process", "the issue of ordering"]
    def hits(line: str) -> bool:
        return any(p.search(line) for p in EVERYWHERE.values())
    assert all(hits(line) for line in caught), [line for line in caught if not hits(line)]
    assert not any(hits(line) for line in fine), [line for line in fine if hits(line)]
    assert IN_DOCS["a measurement call by number"].search("(call 3, `table`)")
