"""`bench/device_runs.sh` (the GPU measurements) stays runnable where no GPU is: it parses, every
phase its usage names has a branch, and the modules, tests and profile settings it names exist."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from profiles import Profile
from profiles.loader import load_profile

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "device_runs.sh"


@pytest.fixture(scope="module")
def text() -> str:
    return SCRIPT.read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_phase_in_the_usage_has_a_branch(text) -> None:
    usage = re.search(r"PHASE=\$\{1:\?usage: device_runs\.sh ([^}]+)\}", text).group(1)
    phases = {p.split()[0] for p in usage.split("|")}
    branches = set(re.findall(r"^([a-z0-9]+)\)", text, re.M))
    assert phases == branches
    assert {"table", "ceilings", "peer"} <= phases


def test_the_modules_and_tests_it_runs_exist(text) -> None:
    modules = set(re.findall(r"python3 -m (bench\.[a-z0-9_.]+)", text))
    assert modules and all(importlib.util.find_spec(m) for m in modules), modules
    for path in set(re.findall(r"(tests/[a-z0-9_/]+\.py)", text)):
        assert (REPO / path).is_file(), path


def test_the_settings_of_each_phase_make_a_valid_profile(text) -> None:
    """Each phase's `--set`s together load over the profile it serves: a setting renamed, or a
    pair the schema refuses, fails here and not on a GPU. A value from a shell variable is its
    default (`${X:-default}`) when it has one; without one only its key is checked."""
    fields = {f"{section.name}.{field.name}" for section in msgspec.structs.fields(Profile)
              for field in msgspec.structs.fields(section.type)}
    for phase in re.split(r"^(?=[a-z0-9]+\))", text.split("case $PHASE in", 1)[1], flags=re.M):
        overrides = []
        for key, value in re.findall(r"--set ([a-z0-9_]+\.[a-z0-9_]+)=([^\s\"]+)", phase):
            assert key in fields, key
            default = re.fullmatch(r"\$\{\w+:-([^}]*)\}", value)
            if default:
                overrides.append(f"{key}={default.group(1)}")
            elif "$" not in value:
                overrides.append(f"{key}={value}")
            elif key.endswith("_dir"):  # a directory named after the server
                overrides.append(f"{key}=/tmp/x")
        load_profile("high-concurrency", overrides)


def test_the_pass_summary_line_prints_from_a_timeline_with_gpu_spans(text, tmp_path) -> None:
    """The one-line summary `summaries` prints per measured pass runs on what `bench.timeline`
    writes, GPU spans and their fit included: a typo there would lose a GPU run's figures."""
    from bench.timeline import summarize

    snippet = re.search(r"^summaries\(\) \{.*?<<'PY'\n(.*?)\nPY\n", text, re.S | re.M).group(1)
    events = []
    for i, (rows, tokens) in enumerate([(64, 0), (64, 700), (80, 0), (48, 300), (96, 1500), (70, 0)]):
        span = (2.0 + 0.05 * rows + 0.01 * tokens) / 1e3
        events.append({"k": "talker_step", "t": 0.02 * i, "dur": 0.015, "emit": 0.0, "drain": 0.0, "admit": 0.0,
                       "batch": rows, "frames": rows, "prefill": tokens, "gpu_idle": 0.0,
                       "gpu_steps": [[span, rows, tokens]]})
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps([summarize(events)]))
    out = subprocess.run([sys.executable, "-", str(path), "nv C=128"],
                         input=snippet, capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.startswith("nv C=128 | talker step")
    assert "2.00 ms + 0.050 ms a decode row + 10.0 us a prompt token" in out
