"""`bench/device_runs.sh` (the GPU measurements) stays runnable where no GPU is: it parses, every
phase its usage names has a branch, and the modules, tests and profile settings it names exist."""

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

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
    """Each phase's `--set`s together (shell variables as a plain value) load over the profile it
    serves: a setting renamed, or a pair the schema refuses, fails here and not on a GPU."""
    for phase in re.split(r"^(?=[a-z0-9]+\))", text.split("case $PHASE in", 1)[1], flags=re.M):
        overrides = [f"{key}={'/tmp/x' if '$' in value else value}"
                     for key, value in re.findall(r"--set ([a-z0-9_]+\.[a-z0-9_]+)=([^\s\"]+)", phase)]
        load_profile("high-concurrency", overrides)
