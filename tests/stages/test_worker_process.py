"""A worker process's set-up (`prepare_process`), in a spawned process as the launcher makes one."""

import multiprocessing as mp
import os

from profiles import load_profile
from stages.workers.common import WorkerSpec, prepare_process


class _NoModel:
    """Stands in for the checkpoint's variant: the set-up only constructs it."""

    def __init__(self, model_dir: str, profile) -> None:
        self.model_dir = model_dir


def _report_set_up(parent_pid: int, out) -> None:
    import torch

    before = torch.backends.cuda.cudnn_sdp_enabled()
    spec = WorkerSpec(stage="codec", variant=_NoModel, model_dir="unused", profile=load_profile("default"),
                      device="cpu", instance="t", inbox=None, to_coord=None, setup=None, parent_pid=parent_pid)
    variant = prepare_process(spec, torch_threads=1)
    out.put((before, torch.backends.cuda.cudnn_sdp_enabled(), torch.get_num_threads(), variant.model_dir))


def test_a_worker_leaves_cudnn_out_of_attention_so_no_eager_step_builds_a_plan():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_report_set_up, args=(os.getpid(), out))
    p.start()
    before, after, threads, model_dir = out.get(timeout=120)
    p.join(timeout=30)
    assert p.exitcode == 0
    assert before is True  # torch's default: cuDNN is one of the kernels it may pick
    assert after is False
    assert (threads, model_dir) == (1, "unused")


def _report_compile_caches(parent_pid: int, env: tuple, out) -> None:
    spec = WorkerSpec(stage="talker", variant=_NoModel, model_dir="unused", profile=load_profile("cpu"),
                      device="cpu", instance="t", inbox=None, to_coord=None, setup=None, parent_pid=parent_pid,
                      env=env)
    prepare_process(spec, torch_threads=1)
    import torch._functorch.config
    import torch._inductor.config
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from triton import knobs

    out.put((cache_dir(), knobs.cache.dir, torch._inductor.config.fx_graph_cache,
             torch._functorch.config.enable_autograd_cache))


def test_a_worker_compiles_into_the_profiles_compile_cache_dir(tmp_path, monkeypatch):
    """`engine.compile_cache_dir` reaches torch in a spawned worker (its spec's environment, as
    `engine.worker_procs.spawn_worker` makes it): inductor's and Triton's cache folders are its
    inductor/ and triton/, and the compiled-graph and AOT autograd caches are on; a variable the
    server's environment already sets wins (the worker inherits it); null, or a folder that
    cannot be made, leaves torch's own places."""
    from stages.workers.placement import compile_cache_environment

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    profile = load_profile("cpu", [f"engine.compile_cache_dir={tmp_path}/caches"])
    env = tuple(compile_cache_environment(profile).items())
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_report_compile_caches, args=(os.getpid(), env, out))
    p.start()
    inductor, triton, fx_graph_cache, autograd_cache = out.get(timeout=120)
    p.join(timeout=30)
    assert p.exitcode == 0
    assert (inductor, triton) == (f"{tmp_path}/caches/inductor", f"{tmp_path}/caches/triton")
    assert fx_graph_cache is True and autograd_cache is True
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert "TRITON_CACHE_DIR" not in compile_cache_environment(profile)
    assert compile_cache_environment(load_profile("cpu", ["engine.compile_cache_dir=null"])) == {}
    (tmp_path / "a-file").write_text("")  # a folder that cannot be made: torch's own places
    assert compile_cache_environment(load_profile("cpu", [f"engine.compile_cache_dir={tmp_path}/a-file/c"])) == {}
