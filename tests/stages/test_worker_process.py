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
