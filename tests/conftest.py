"""Shared test helpers: where the golden fixtures live (tests/golden/, described in its README.md),
loading a golden case or codec, one intra-op torch thread for modules of tiny tensors, Triton's CPU
interpreter only for the modules that ask for it, and a speech job for request adapters."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from speech.job import SpeechJob

GOLDEN_ROOT = Path(__file__).resolve().parent / "golden"


def pytest_configure(config) -> None:
    """A worker of a parallel run (pytest-xdist) computes with one intra-op torch thread: the
    workers already use every core, and more threads than cores make torch's small ops wait
    on each other (a module of small-op tests ran 3.4x slower with two threads a worker on two
    cores)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


# The modules that keep a worker busy longest on a two-core CPU machine (about a minute or more
# each: Triton's interpreter, six servers at once, replicas killed and restarted), longest first.
# A parallel run hands them out first: pytest-xdist's loadscope order (most tests first) left the
# batch-invariance modules (one and three tests, 60 and 160 s) for the end, where one worker ran
# them alone while the other had finished.
LONG_MODULES = (
    "tests/api/test_batch_invariant_server.py",
    "tests/stages/test_batch_invariant_runners.py",
    "tests/api/test_variants_server.py",
    "tests/stages/test_codec_ring_attention.py",
    "tests/stages/test_sampling_kernel.py",
    "tests/api/test_speech_e2e.py",
    "tests/stages/test_local_v15_graph_path.py",
    "tests/stages/test_batch_invariant_realtime.py",
    "tests/engine/test_replicas.py",
    "tests/stages/test_qk_rope_store.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` (make test) with `LONG_MODULES` handed out before every other module."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LongModulesFirst(LoadScopeScheduling):
        def _assign_work_unit(self, node) -> None:
            queue = getattr(self, "workqueue", None)  # xdist's own queue (an OrderedDict in 3.x);
            for module in reversed(LONG_MODULES):  # without it, xdist's order as it is
                if queue is not None and module in queue:
                    queue.move_to_end(module, last=False)
            super()._assign_work_unit(node)

    return LongModulesFirst(config, log)


def golden_dir(name: str) -> Path:
    """The golden fixture folder `name` (tests/golden/), or skip with the reason when it is absent:
    the test that asks, or the whole module when a module asks at import."""
    path = GOLDEN_ROOT / name
    if not (path / "config.json").is_file():
        pytest.skip(f"golden fixtures not found at {path} (tests/golden/README.md)", allow_module_level=True)
    return path


def golden_case(folder: Path, name: str) -> dict[str, np.ndarray]:
    """The arrays of `<folder>/case_<name>.npz`."""
    with np.load(folder / f"case_{name}.npz") as z:
        return {k: z[k] for k in z.files}


def golden_codec(folder: Path):
    """The golden tiny codec in `folder` and its `cases.npz` arrays."""
    from stages.models.codec import load_codec

    return load_codec(folder), dict(np.load(folder / "cases.npz"))


def golden_error(label: str, got: np.ndarray, want: np.ndarray) -> float:
    """Max abs error of `got` against the golden `want` (shapes must match), printed with `label`."""
    assert got.shape == want.shape, f"{label}: shape {got.shape} vs {want.shape}"
    err = float(np.abs(got.astype(np.float64) - want).max()) if got.size else 0.0
    print(f"{label}: max abs error {err:.3g}")
    return err


def speech_job(text: str = "hello world", **fields) -> SpeechJob:
    """A speech job for request adapters, with a default text."""
    return SpeechJob(text=text, **fields)


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter_where_imported(request):
    """Triton's CPU interpreter (TRITON_INTERPRET=1, set by `tests.triton_cpu`) is on only for the
    modules that import that helper (`from tests import triton_cpu`). A pytest-xdist worker
    collects every module, so the variable is set in every worker; a kernel path chosen by it
    (`triton_runs_on`) would then run the interpreter in tests written for the torch ops and in
    the servers they start (the float8 precision checks took 123 s in a parallel run, 2.7 s
    alone). Module-scoped, so it is in force before a module's own fixtures start servers."""
    helper = sys.modules.get("tests.triton_cpu")
    if helper is None or getattr(request.module, "triton_cpu", None) is helper:
        yield
        return
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TRITON_INTERPRET", raising=False)
        yield


@pytest.fixture(scope="session")
def local_v15_dir() -> Path:
    """The tiny random-weight Local-v1.5 golden checkpoint (skips without the fixtures)."""
    return golden_dir("moss_tts_local_v1_5")


@pytest.fixture(scope="session")
def local_v15_model(local_v15_dir):
    """Its talker, loaded once (fp32, CPU); tests build runners over it and never change it."""
    from stages.models.local_v15.loader import load_talker

    return load_talker(local_v15_dir)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: one intra-op thread is fastest, and stays fast on a shared, loaded machine.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
