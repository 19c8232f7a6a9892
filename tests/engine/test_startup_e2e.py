"""A real `mossvox serve` start-up (tiny demo model, cpu profile) says what it does as it goes:
where the compile caches are, each worker's weights read and load, the talker's warm-up batches
(n of N, in order: on the CPU the first two only, since nothing there is compiled for a shape and
the serving-size batches would only cost time), each worker's breakdown, and last the engine's
line from launch to Ready, whose every worker's phases add up to that worker's total. (Nothing compiles or is captured on
the CPU; those lines are tests/stages/test_startup_log.py's.)"""

import re

import pytest

from tests.api.server_process import ServerProcess

PHASES = r"start ([\d.]+), load ([\d.]+), compile ([\d.]+), capture ([\d.]+), warm-up ([\d.]+)"


@pytest.fixture(scope="module")
def log(tmp_path_factory) -> list[str]:
    data = tmp_path_factory.mktemp("startup")
    with pytest.MonkeyPatch.context() as env:  # (torch sets the first once it has compiled in this process)
        env.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        env.delenv("TRITON_CACHE_DIR", raising=False)
        server = ServerProcess(data, sets=(f"engine.compile_cache_dir={data}/compile",)).start()
    server.stop()
    return server.log


def index(log: list[str], pattern: str) -> int:
    """The index of the first line matching `pattern` (fails naming it when none does)."""
    found = [i for i, line in enumerate(log) if re.search(pattern, line)]
    assert found, f"no line matches {pattern!r}"
    return found[0]


def test_the_start_up_says_what_it_does_in_order(log):
    caches = index(log, r"engine\.launcher INFO: compile caches: inductor \S+/compile/inductor, "
                        r"triton \S+/compile/triton$")
    weights = index(log, r"talker0\[\d+\] INFO stages\.runtime\.checkpoint: weights: [\d.]+ [MG]B from 1 file\(s\) "
                         r"of \S+ to cpu in [\d.]+ s, ")
    loaded = index(log, r"talker: loaded in [\d.]+ s$")
    batches = [index(log, rf"talker: warm-up batch {i} of 2 \({name}: \d+ requests?, \d+ prompt rows\): [\d.]+ s$")
               for i, name in ((1, "alone"), (2, "two"))]
    assert not any("(serving:" in line or "(wide:" in line for line in log)
    ready = index(log, r"talker: ready in [\d.]+ s: start ")
    codec = index(log, r"codec: ready in [\d.]+ s: start ")
    engine = index(log, r"engine ready in [\d.]+ s after launch; ")
    assert caches < weights < loaded < batches[0] < batches[1] < ready < engine
    assert codec < engine


def test_the_last_line_breaks_each_worker_down_and_the_phases_add_up(log):
    line = log[index(log, r"engine ready in [\d.]+ s after launch; ")]
    total = float(re.search(r"engine ready in ([\d.]+) s", line).group(1))
    workers = re.findall(rf"(talker|codec)0 ([\d.]+) s \({PHASES}\)", line)  # named as their log lines
    assert sorted(w[0] for w in workers) == ["codec", "talker"]
    for name, worker_total, *phases in workers:
        assert abs(sum(map(float, phases)) - float(worker_total)) <= 0.26  # five parts rounded to 0.1 s
        assert float(worker_total) <= total + 0.1  # each from its spawn, within the launch
        own = log[index(log, rf"{name}: ready in {worker_total} s: ")]
        assert re.search(r"start ([\d.]+) s, load ([\d.]+) s, compile ([\d.]+) s \(0 compiles\), "
                         r"capture ([\d.]+) s \(0 graphs\), warm-up ([\d.]+) s", own).groups() == tuple(phases)
