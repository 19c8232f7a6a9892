"""Shared test helpers: where the golden fixtures live (`shared/golden/` beside the repository)."""

from pathlib import Path

import pytest

GOLDEN_ROOT = Path(__file__).resolve().parents[2] / "shared" / "golden"


def golden_dir(name: str) -> Path:
    """`shared/golden/<name>`, or skip the test with the reason when it is absent."""
    path = GOLDEN_ROOT / name
    if not path.is_dir():
        pytest.skip(f"golden fixtures not found at {path} (clone shared/ beside the repository)")
    return path
