"""Tensor parallelism on CPU with gloo: real ranks in real processes.

Parallel linears against the full matmul; a TP=2 Delay model against TP=1 (hidden states and
logits, dense and paged paths); a greedy generation through the real launcher (`start_delay_tp`)
equal to TP=1 and to upstream; followers that exit cleanly on close and die with their parent.
"""

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import textwrap
import time
from dataclasses import fields

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_map

from profiles import load_profile
from speech.sampling import SamplingParams
from stages.models.delay.model import DelayModel
from stages.models.delay.runner import DelayRunner
from stages.models.delay.tp_runner import LaunchedTPDelayRunner, from_step_wire, start_delay_tp, step_wire
from stages.models.qwen3 import Qwen3Config, fuse_projections
from stages.registry import load_variant
from stages.runtime.attention.metadata import build_attention_metadata
from stages.runtime.kv_cache import KVCacheSpec, PagedKVCache
from stages.runtime.tensor_parallel import (MULTICAST_OFF, ColumnParallelLinear, RowParallelLinear, TPGroup, destroy_tp,
                                    free_port, init_tp)
from stages.tools.make_checkpoint import make_checkpoint
from stages.variant import UnknownModel
from stages.workers.tp_ranks import tp_devices
from tests.conftest import golden_dir, speech_job

ATOL = 1e-5
GREEDY = SamplingParams(greedy=True, temperature=0.0, text_temperature=0.0, max_new_frames=1000)


def run_ranks(fn, *args, size: int = 2) -> list:
    """fn(tp, *args) on `size` spawned gloo ranks; their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(fn, address, size, rank, results, args)) for rank in range(size)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    errors = [v for v in out.values() if isinstance(v, str)]
    assert not errors, errors[0]
    return [tree_map(lambda v: torch.from_numpy(v) if isinstance(v, np.ndarray) else v, out[r]) for r in range(size)]


def _rank_main(fn, address, size, rank, results, args):
    torch.set_num_threads(1)
    tp = init_tp(size, rank, address, "cpu")
    try:
        result = fn(tp, *args)  # tensors travel as numpy: torch's shared-memory handles die with the rank
        results.put((rank, tree_map(lambda v: v.numpy() if isinstance(v, torch.Tensor) else v, result)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, f"rank {rank}: {exc!r}"))
    finally:
        destroy_tp()


# ---- ranks: parallel linears and the model, TP=2 against TP=1 ------------------------------------


@pytest.fixture(scope="module")
def tiny_delay(tmp_path_factory):
    out = tmp_path_factory.mktemp("delay_tiny")
    make_checkpoint(out, variant="delay", size="tiny", seed=3)
    return out


@pytest.fixture(scope="module")
def linear_inputs():
    torch.manual_seed(0)
    return torch.randn(3, 6), torch.randn(8, 6), torch.randn(6, 8)  # x, W_col, W_row: hidden 6, inner 8


@pytest.fixture(scope="module")
def model_inputs(tiny_delay):
    torch.manual_seed(1)
    config = DelayModel.from_dir(tiny_delay).config
    ids = torch.cat([torch.randint(0, 600, (2, 6, 1)), torch.randint(0, config.audio_rows, (2, 6, config.n_vq))],
                    dim=-1)  # [B, S, 1 + n_vq]
    mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])  # left padding on row 0
    return tiny_delay, ids, mask


def _linears(tp: TPGroup, x, w_col, w_row):
    col = ColumnParallelLinear(w_col.shape[1], w_col.shape[0], tp)
    row = RowParallelLinear(w_row.shape[1], w_row.shape[0], tp)
    with torch.no_grad():
        col.weight.copy_(col.shard(w_col))
        row.weight.copy_(row.shard(w_row))
        y = col(x)  # [B, out / size]: this rank's columns, no communication
        return y, row(y), os.environ.get("NCCL_NVLS_ENABLE")  # [B, hidden] after the all-reduce


def _model_outputs(tp: TPGroup | None, model_dir, ids, mask, fused: bool = False):
    """Dense hidden + heads, then the paged path: a 5-row prefill and one decode row per sequence
    (`fused`: with the backbone's projections fused and its KV stores in the layers)."""
    torch.manual_seed(0)
    model = DelayModel.from_dir(model_dir, tp=tp)
    if fused:
        fuse_projections(model)
        model.language_model.store_kv_in_layers()
    with torch.inference_mode():
        hidden = model.forward_dense(ids, mask)  # [B, S, H]
        out = {"hidden": hidden, "text": model.text_logits(hidden), "audio": model.audio_logits(hidden)}
        cfg = model.language_model.rank_config
        cache = PagedKVCache(cfg.kv_cache_spec(8, 4), dtype=torch.float32, device="cpu")
        paged = []
        for start, n in ((0, 5), (5, 1)):
            meta = build_attention_metadata(cache, [(b, n) for b in range(ids.shape[0])], "cpu")
            paged.append(model(ids[:, start:start + n].flatten(0, 1), meta, cache))  # [B * n, H]
        out["paged"] = torch.cat(paged)
        out["kv_heads"] = cache.keys[0].shape[2]
    return out


def _both(tp: TPGroup, linear_args, model_args):
    """One spawn for every check (starting ranks is most of the cost)."""
    return _linears(tp, *linear_args), _model_outputs(tp, *model_args), _model_outputs(tp, *model_args, fused=True)


@pytest.fixture(scope="module")
def two_ranks(linear_inputs, model_inputs):
    """Per rank: (linear outputs, model outputs) computed on two gloo ranks."""
    return run_ranks(_both, linear_inputs, model_inputs)


def test_column_then_row_parallel_equals_full_matmuls(two_ranks, linear_inputs):
    x, w_col, w_row = linear_inputs
    ranks = [linears for linears, *_ in two_ranks]
    full = x @ w_col.T  # [3, 8]
    torch.testing.assert_close(torch.cat([y for y, _, _ in ranks], dim=-1), full, atol=ATOL, rtol=0)
    for _, z, nvls in ranks:  # every rank holds the whole all-reduced output
        torch.testing.assert_close(z, full @ w_row.T, atol=ATOL, rtol=0)
        assert nvls == MULTICAST_OFF["NCCL_NVLS_ENABLE"]


def test_tp2_model_equals_tp1_hidden_and_logits(two_ranks, model_inputs):
    want = _model_outputs(None, *model_inputs)
    for _, got, _ in two_ranks:
        for key in ("hidden", "text", "audio", "paged"):
            torch.testing.assert_close(got[key], want[key], atol=ATOL, rtol=0, msg=key)
        assert got["kv_heads"] == want["kv_heads"] // 2  # the KV cache is split by KV heads


def test_tp2_fused_projections_stack_each_rank_slices(two_ranks, model_inputs):
    """Each rank's q/k/v and gate/up slices stacked into one matmul (and its KV stores in the
    layers): the unsplit, unfused model's outputs."""
    want = _model_outputs(None, *model_inputs)
    for _, _, got in two_ranks:
        for key in ("hidden", "text", "audio", "paged"):
            torch.testing.assert_close(got[key], want[key], atol=ATOL, rtol=0, msg=key)


def test_step_inputs_survive_the_wire():
    cache = PagedKVCache(KVCacheSpec(1, 1, 4, 8, 4), dtype=torch.float32, device="cpu")
    cache.append_slots(0, 6)
    meta = build_attention_metadata(cache, [(0, 1), (1, 3)], "cpu")
    ids = torch.arange(8).view(4, 2)
    got_ids, got = from_step_wire(pickle.loads(pickle.dumps(step_wire(ids, meta))), torch.device("cpu"))
    torch.testing.assert_close(got_ids, ids)
    for f in fields(meta):
        want = getattr(meta, f.name)
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(getattr(got, f.name), want, msg=f.name)
        else:
            assert getattr(got, f.name) == want


def test_rank_devices():
    assert tp_devices("cuda", 2) == ["cuda:0", "cuda:1"] and tp_devices("cuda:2", 2) == ["cuda:2", "cuda:3"]
    assert tp_devices("cpu", 2) == ["cpu", "cpu"]


def test_shapes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="does not split"):
        TPGroup(0, 3, None, None).split(torch.zeros(4, 2), 0)
    cfg = Qwen3Config(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=10)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        cfg.per_rank(4)
    assert cfg.per_rank(2).num_kv_heads == 1 and cfg.per_rank(2).intermediate_size == 64


# ---- the runner through the real launcher ---------------------------------------------------------


def _prompts():
    golden = golden_dir("moss_tts_delay")
    cases = {}
    for rid, name in enumerate(("plain", "voice_clone")):
        with np.load(golden / f"case_{name}.npz") as z:
            cases[rid] = (z["input_ids"], z["generated_rows"])
    return golden, cases


def _generate(runner, cases, steps: int) -> dict[int, np.ndarray]:
    for rid, (prompt, _) in cases.items():
        runner.add(rid, prompt, GREEDY)
    for _ in range(steps):
        runner.step()
    return {rid: runner.rows(rid) for rid in cases}


def test_tp2_greedy_generation_equals_tp1_and_followers_exit():
    golden, cases = _prompts()
    options = {"max_running": 4, "num_kv_blocks": 64, "prefill_chunk_tokens": 48, "finish_on_audio_end": False}
    want = _generate(DelayRunner.from_dir(golden, **options), cases, 20)
    runner = start_delay_tp(golden, devices=["cpu", "cpu"], torch_threads=1, **options)
    try:
        follower = runner.ranks.processes[0]
        assert runner.scheduler.cache.keys[0].shape[2] == 1  # 2 KV heads, one per rank
        got = _generate(runner, cases, 20)
    finally:
        runner.close()
    for rid, (prompt, upstream) in cases.items():
        np.testing.assert_array_equal(got[rid], want[rid])
        generated = len(got[rid]) - len(prompt)
        assert generated >= 20 - 8  # the two prompts (prefilled 48 rows a step) also generated
        np.testing.assert_array_equal(got[rid][len(prompt):], upstream[:generated])
    assert runner.exit_codes == [0] and follower.poll() == 0


def test_a_dead_follower_fails_the_step_at_once():
    golden, cases = _prompts()
    runner = start_delay_tp(golden, devices=["cpu", "cpu"], torch_threads=1, max_running=1, num_kv_blocks=16)
    try:
        runner.add(0, cases[0][0], GREEDY)
        runner.step()
        follower = runner.ranks.processes[0]
        follower.kill()
        follower.wait()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+, exit code -9\) exited: the group is broken"):
            runner.step()
        assert time.monotonic() - start < 5  # an error the talker worker reports, not a hang
    finally:
        runner.close()
    assert runner.exit_codes == [-9]


def test_profile_tensor_parallel_gives_the_talker_worker_a_tp_runner(tiny_delay):
    """`talker.tensor_parallel: 2` through the variant the talker worker uses: seeded sampling, same rows."""
    rows = {}
    for tp in (1, 2):
        variant = load_variant(tiny_delay, load_profile("cpu", [f"talker.tensor_parallel={tp}"]))
        runner = variant.make_talker_runner("cpu")
        try:
            request = variant.build_request(speech_job(text="hello tensor parallel world", sampling={"seed": 11}))
            prompt, sampling = request.prompt, request.sampling
            runner.add(5, prompt, sampling)
            for _ in range(12):
                runner.step()
            rows[tp] = runner.rows(5)
        finally:
            if tp == 2:
                assert isinstance(runner, LaunchedTPDelayRunner)
                runner.close()
    assert runner.exit_codes == [0]
    np.testing.assert_array_equal(rows[2], rows[1])
    assert len(rows[1]) == len(prompt) + 12


def test_tensor_parallel_is_refused_for_other_families(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "moss_tts_local"}')
    with pytest.raises(UnknownModel, match="talker.tensor_parallel 2"):
        load_variant(tmp_path, load_profile("cpu", ["talker.tensor_parallel=2"]))


ORPHAN_SCRIPT = textwrap.dedent("""
    import os, sys
    from stages.models.delay.tp_runner import LaunchedTPDelayRunner, start_delay_tp
    from stages.workers.tp_ranks import tp_devices
    runner = start_delay_tp(sys.argv[1], devices=["cpu", "cpu"], num_kv_blocks=8, max_running=1, torch_threads=1)
    print(runner.ranks.processes[0].pid, flush=True)
    os._exit(0)  # rank 0 dies without closing
""")


def test_followers_die_with_rank0():
    golden = golden_dir("moss_tts_delay")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", ORPHAN_SCRIPT, str(golden)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
