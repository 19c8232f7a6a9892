"""MOSS-TTS-Realtime in the batch-invariant mode: the mode's kernels run in its backbone and in its
depth loop (replayed on the graph path's static inputs), and a seeded request gives the same
frames alone, together with others, and arriving among them mid-decode.

CPU: the kernels run under Triton's interpreter (TRITON_INTERPRET=1 set before triton is
imported, as in test_batch_invariant.py); tiny model, few frames."""

from tests import triton_cpu  # noqa: E402, F401  (before triton: its CPU interpreter)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

from speech.sampling import SamplingParams  # noqa: E402
from stages.models.realtime.runner import RealtimeRunner  # noqa: E402
from tests.stages.runner_drive import drive  # noqa: E402
from tests.stages.test_batch_invariant_runners import counted  # noqa: E402
from tests.stages.test_realtime_graphs import model, prompt  # noqa: E402, F401  (model: the fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def invariant_runner(model, max_running: int = 3) -> RealtimeRunner:
    return RealtimeRunner(model, max_running=max_running, num_kv_blocks=64, batch_invariant=True,
                          graph_path="eager")


@pytest.mark.slow  # about 60 s under the interpreter
def test_seeded_requests_alone_together_and_mixed(model):
    cfg = model.config
    two = {rid: (prompt(cfg, rid, prefill=5 + 4 * i),
                 SamplingParams(temperature=0.9, top_k=20, top_p=0.8, repetition_penalty=1.2, seed=40 + rid,
                                forced_frames=2))
           for i, rid in enumerate((1, 2))}
    other = (prompt(cfg, 9, prefill=11), SamplingParams(seed=9, forced_frames=3))
    runner = invariant_runner(model)
    assert runner.attention.batch_invariant and runner.depth_graphs is not None
    calls = counted(runner)
    together = drive(runner, {0: [(rid, p, s) for rid, (p, s) in two.items()]})
    assert {"linear", "rms_norm", "attention", "cumsum"} <= set(calls), calls  # backbone, depth loop, sampler
    assert len({f.tobytes() for f in together.values()}) == 2
    mixed = drive(invariant_runner(model), {0: [(9, *other)], 1: [(rid, p, s) for rid, (p, s) in two.items()]})
    for rid, (p, s) in two.items():
        alone = drive(invariant_runner(model, max_running=1), {0: [(rid, p, s)]})[rid]
        assert len(alone) == 2
        np.testing.assert_array_equal(alone, together[rid], err_msg=f"{rid}: alone vs together")
        np.testing.assert_array_equal(alone, mixed[rid], err_msg=f"{rid}: alone vs mixed")
