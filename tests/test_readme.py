"""README.md stays short and true to the shipped profiles: what its profile table says each
profile changes is what the profile files load to."""

import re
from pathlib import Path

import pytest

from profiles import load_profile, shipped_profiles

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def profile_row(name: str) -> str:
    row = re.search(rf"^\| `{re.escape(name)}` \|(.*)$", README, re.MULTILINE)
    assert row, f"README's profile table has no row for {name}"
    return row.group(1)


def test_the_readme_is_short() -> None:
    assert len(README.splitlines()) <= 200


def test_every_shipped_profile_has_a_row() -> None:
    for name in shipped_profiles():
        profile_row(name)


@pytest.mark.parametrize("name, says, holds", [
    ("default", "up to 256 streams", lambda p: p.talker.max_running == p.admission.max_running == 256),
    ("default", "a prefill chance every step", lambda p: p.talker.prefill_interval == 1),
    ("default", "first chunk 1 frame then 15",
     lambda p: (p.chunking.initial_chunk_frames, p.chunking.ramp, p.chunking.chunk_frames) == (1, (), 15)),
    ("high-concurrency", "4 API processes", lambda p: p.api.api_servers == 4),
    ("high-concurrency", "32 ready streams or 25 ms",
     lambda p: (p.coalescing.min_batch, p.coalescing.max_wait_ms) == (32, 25)),
    ("high-concurrency", "cuts long chunks", lambda p: p.codec.split_chunks),
    ("high-concurrency", "mixed decode-and-prefill graphs", lambda p: p.talker.mixed_step_tokens > 0),
    ("high-concurrency", "one step ahead", lambda p: p.talker.overlap_steps),
    ("high-concurrency", "bf16 weights (float8 backbone matmuls opt-in)",
     lambda p: p.talker.fp8_weights == "none" and p.talker.kv_cache_dtype == "auto"),
    ("high-concurrency", "ramp 1, 2, 4, 8, 15",
     lambda p: (p.chunking.initial_chunk_frames, *p.chunking.ramp, p.chunking.chunk_frames) == (1, 2, 4, 8, 15)),
    ("low-latency", "2 API processes", lambda p: p.api.api_servers == 2),
    ("low-latency", "at most 64 streams", lambda p: p.talker.max_running == 64),
    ("low-latency", "as soon as one chunk is ready", lambda p: p.coalescing.min_batch == 1),
    ("low-latency", "ramp 1, 2, 4, 8, 15",
     lambda p: (p.chunking.initial_chunk_frames, *p.chunking.ramp, p.chunking.chunk_frames) == (1, 2, 4, 8, 15)),
    ("cpu", "16 streams", lambda p: p.talker.max_running == 16),
    ("cpu", "float32", lambda p: p.model.dtype == "float32"),
    ("cpu", "no CUDA graphs", lambda p: not (p.talker.cuda_graphs or p.codec.cuda_graphs)),
    ("cpu", "the length forced from the text", lambda p: p.model.force_length_from_text),
])
def test_what_the_profile_table_says_is_what_the_profiles_hold(name, says, holds) -> None:
    assert says in profile_row(name), f"README no longer says '{says}' for {name}: update this test"
    assert holds(load_profile(name)), f"README says '{says}' for {name}, which the profile does not hold"
