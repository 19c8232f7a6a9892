"""The set-up is quiet but says what it does: the package builds without a warning from the build
backend, and each install step of `make serve` / `make test` names itself in one line while pip
prints nothing unless it fails. (The installs themselves need the network; CI runs them.)"""

import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_package_metadata_builds_without_a_warning() -> None:
    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(REPO / "pyproject.toml"))
    assert [str(w.message).splitlines()[0] for w in caught] == [], setuptools.__version__
    assert dist.metadata.license_expression == "Apache-2.0"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_every_install_step_is_quiet_and_announced() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    steps = subprocess.run(["make", "--no-print-directory", "-n", "-B", "venv"], cwd=REPO, env=env,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    installs = [i for i, line in enumerate(steps) if " pip install " in line]
    assert len(installs) >= 3
    for i in installs:
        assert re.search(r"pip install (-\S+ )*-q\b", steps[i]), steps[i]  # pip quiet
        assert steps[i - 1].startswith("echo ") and "mossvox:" in steps[i - 1], steps[i - 1]
    assert steps[-1].startswith("echo ") and "ready" in steps[-1]
