"""The talker runners in the batch-invariant mode (`batch_invariant=True`): the kernels really run
(the mode's calls are counted), the results stay right (greedy = the upstream golden codes), and a
seeded request gives the same codes alone, among its seven peers, and mixed with other requests.

CPU: the mode's Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1 set before
triton is imported, as in test_batch_invariant.py); tiny model, few frames: the interpreter is slow.
"""

from tests import triton_cpu  # noqa: E402, F401  (before triton: its CPU interpreter)

import collections  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

from speech.sampling import SamplingParams  # noqa: E402
from stages.models.local_v15.runner import LocalV15Runner  # noqa: E402
from stages.runtime.batch_invariant import BatchInvariantKernels  # noqa: E402
from tests.stages.runner_drive import drive  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompt(golden, name="plain"):
    with np.load(golden / f"case_{name}.npz") as z:
        return z["input_ids"], z["generated_audio_codes"]


def counted(runner) -> collections.Counter:
    """Count the mode's kernel calls of `runner` (by kernel name)."""
    calls = collections.Counter()
    kernels = runner.kernels
    for name in ("linear", "rms_norm", "layer_norm", "cumsum", "sum", "attention"):
        real = getattr(kernels, name)
        setattr(kernels, name, lambda *a, _real=real, _name=name, **kw: calls.update([_name]) or _real(*a, **kw))
    return calls


def invariant_runner(model, **kw) -> LocalV15Runner:
    opts = dict(max_running=16, kv_block_size=8, num_kv_blocks=256, prefill_chunk_tokens=24,
                max_prefill_tokens_per_step=40, batch_invariant=True)
    return LocalV15Runner(model, **(opts | kw))


def test_mode_runs_its_kernels_and_greedy_still_equals_the_golden(local_v15_model, local_v15_dir):
    ids, codes = prompt(local_v15_dir)
    runner = invariant_runner(local_v15_model, graph_path="eager")
    assert isinstance(runner.kernels, BatchInvariantKernels) and runner.attention.batch_invariant
    calls = counted(runner)
    frames = drive(runner, {0: [(1, ids, SamplingParams(greedy=True, max_new_frames=4))]})[1]
    np.testing.assert_array_equal(frames, codes[:4])
    # backbone linears and norms, the local block's layer norms and attention, the heads
    assert {"linear", "rms_norm", "layer_norm", "attention"} <= set(calls), calls


def eight_and_others(golden):
    """8 seeded requests (different seeds, settings, prompt lengths) and 4 other requests; short
    prompts and two frames each (the interpreter runs every kernel program in numpy)."""
    base = [prompt(golden, n)[0] for n in ("plain", "voice_clone", "continuation")]
    settings = [dict(), dict(top_k=5), dict(top_p=0.5, repetition_penalty=1.3), dict(temperature=0.8, top_k=0),
                dict(repetition_penalty=1.1), dict(top_k=1), dict(text_temperature=1.5), dict(temperature=2.0)]
    eight = {100 + i: (base[i % 3][: 12 - i],
                       SamplingParams(seed=1000 + 7 * i, max_new_frames=2, forced_frames=2, **s))
             for i, s in enumerate(settings)}
    others = {200 + i: (base[(i + 1) % 3][: 20 - 3 * i], SamplingParams(seed=5 + i, max_new_frames=3, forced_frames=3))
              for i in range(4)}
    return eight, others


@pytest.mark.slow  # about 100 s under the interpreter
def test_eight_seeded_requests_alone_together_and_mixed(local_v15_model, local_v15_dir):
    eight, others = eight_and_others(local_v15_dir)
    runner = invariant_runner(local_v15_model)
    calls = counted(runner)
    together = drive(runner, {0: [(rid, p, s) for rid, (p, s) in eight.items()]})
    assert calls["linear"] and calls["cumsum"]  # the sampler's scans ran in the mode too
    assert len({f.tobytes() for f in together.values()}) == len(eight)  # each its own codes
    # mixed: the others arrive first and on later steps, so the eight share steps with prefills
    mixed = drive(invariant_runner(local_v15_model, graph_path="eager"),
                  {0: [(rid, p, s) for rid, (p, s) in list(others.items())[:2]],
                   1: [(rid, p, s) for rid, (p, s) in eight.items()],
                   2: [(rid, p, s) for rid, (p, s) in list(others.items())[2:]]})
    for rid, (p, s) in eight.items():
        alone = drive(invariant_runner(local_v15_model, max_running=1), {0: [(rid, p, s)]})[rid]
        np.testing.assert_array_equal(alone, together[rid], err_msg=f"{rid}: alone vs together")
        np.testing.assert_array_equal(alone, mixed[rid], err_msg=f"{rid}: alone vs mixed")


def test_runner_refuses_a_split_attention_in_the_mode(local_v15_model):
    from stages.runtime.attention.backends import PaddedBatchAttention
    from stages.runtime.attention.triton_paged import TritonPagedAttention

    with pytest.raises(ValueError, match="batch-invariant attention"):
        invariant_runner(local_v15_model, attention=PaddedBatchAttention())
    with pytest.raises(ValueError, match="batch-invariant attention"):
        invariant_runner(local_v15_model, attention=TritonPagedAttention())
    assert LocalV15Runner(local_v15_model, max_running=2, num_kv_blocks=16).kernels is None  # off by default
