"""The talker's step-time budget (`talker.max_step_ms`): with streams decoding, a step prefills no
more than its measured costs say fits, so long prompts are spread over steps; the codes do not
change."""

import numpy as np
import pytest
import torch

from profiles import load_profile
from speech.sampling import SamplingParams
from stages.models.local_v15.loader import load_talker
from stages.models.local_v15.runner import LocalV15Runner
from stages.runtime.kv_cache import KVCacheSpec, PagedKVCache
from stages.runtime.row_scheduler import MIN_STEP_PREFILL_TOKENS, RowScheduler
from stages.runtime.runner_options import talker_options
from tests.conftest import golden_dir


def scheduler(max_step_s):
    cache = PagedKVCache(KVCacheSpec(1, 1, 2, 512, 16), dtype=torch.float32, device="cpu")
    return RowScheduler(cache, max_running=8, prefill_chunk_tokens=4096, max_prefill_tokens_per_step=4096,
                        max_step_s=max_step_s)


def run_step(s, seconds):
    batch = s.schedule()
    s.reserve(batch)
    for r, _ in batch:
        if r.pending == 0:
            r.rows.append(np.zeros(13, np.int64))  # its next row, as a runner appends it
    s.observe_step(seconds)
    return batch


def test_a_decoding_step_takes_only_the_prefill_that_fits():
    s = scheduler(0.050)
    s.add(1, np.zeros((100, 13), np.int64))
    run_step(s, 0.5)  # nothing decoded yet: the whole prompt, no limit, and no cost learnt
    assert s.decode_step_s is None and s.prefill_token_s is None
    for _ in range(3):
        assert run_step(s, 0.010) == [(s.requests[1], 1)]  # decode-only steps: 10 ms
    assert s.decode_step_s == pytest.approx(0.010)
    s.add(2, np.zeros((3000, 13), np.int64))
    s.add(3, np.zeros((3000, 13), np.int64))
    assert s.step_prefill_budget() == 4096  # no prefill cost known yet
    first = run_step(s, 0.010 + 4096 * 1e-4)  # 0.1 ms per prompt token
    assert [(r.rid, n) for r, n in first] == [(1, 1), (2, 3000), (3, 1096)]
    assert s.prefill_token_s == pytest.approx(1e-4)
    assert s.step_prefill_budget() == 400  # (50 - 10) ms / 0.1 ms
    second = run_step(s, 0.050)
    assert [(r.rid, n) for r, n in second] == [(1, 1), (2, 1), (3, 400)]
    s.max_step_s = 0.011  # a budget below a decode step still lets prompts progress
    assert s.step_prefill_budget() == MIN_STEP_PREFILL_TOKENS


def test_without_decoders_or_budget_nothing_is_held_back():
    s = scheduler(None)
    s.add(1, np.zeros((100, 13), np.int64))
    run_step(s, 0.5)
    for _ in range(2):
        run_step(s, 0.010)
    s.add(2, np.zeros((3000, 13), np.int64))
    run_step(s, 0.3)
    assert s.step_prefill_budget() == 4096 and s.requests[2].prefilled == 3000


def test_profile_sets_the_budget():
    assert talker_options(load_profile("cpu", ["talker.max_step_ms=45"]))["max_step_ms"] == 45
    assert talker_options(load_profile("cpu"))["max_step_ms"] is None


def test_runner_codes_do_not_depend_on_the_budget():
    golden = golden_dir("moss_tts_local_v1_5")
    model = load_talker(golden)
    with np.load(golden / "case_voice_clone.npz") as z:
        prompt = z["input_ids"]
    arrivals = {0: [(1, prompt[:40])], 3: [(2, prompt), (3, prompt[:70])]}

    def drive(runner, observe):
        out = {}
        for step in range(200):
            for rid, p in arrivals.get(step, []):
                runner.add(rid, p, SamplingParams(seed=rid, forced_frames=10, temperature=1.0, top_k=20))
            for e in runner.step():
                if e.codes is not None:
                    out.setdefault(e.rid, []).append(e.codes)
            if observe:  # as the talker loop does; a step 'costs' 1 ms plus 1 ms per 10 prompt rows
                decode, prefill = runner.scheduler.last_batch
                runner.scheduler.observe_step(1e-3 + prefill * 1e-4)
            if runner.num_running() == 0 and step > 3:
                return out
        raise AssertionError("did not finish")

    kw = dict(max_running=4, kv_block_size=8, num_kv_blocks=64, prefill_chunk_tokens=512,
              max_prefill_tokens_per_step=512)
    free = drive(LocalV15Runner(model, **kw), observe=False)
    bounded = LocalV15Runner(model, max_step_ms=1.0, **kw)
    got = drive(bounded, observe=True)
    assert bounded.scheduler.step_prefill_budget() == MIN_STEP_PREFILL_TOKENS  # 64 < 75 + 70 rows
    for rid in free:
        np.testing.assert_array_equal(np.stack(got[rid]), np.stack(free[rid]), err_msg=str(rid))
