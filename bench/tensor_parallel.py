"""Delay talker timing at several tensor-parallel sizes, from a checkpoint directory (no codec).

    mossvox make-checkpoint --variant delay --size full --out /tmp/moss-tts-8b
    python -m bench.tensor_parallel --model /tmp/moss-tts-8b --tp 1 2 --batch 1 16 64 --frames 50 \
        [--attention auto|padded|triton] [--no-graphs]

For each TP size the talker is loaded once (TP=1: `DelayRunner`, decode rows from backbone CUDA
graphs unless `--no-graphs`; TP>1: `start_delay_tp` over consecutive GPUs from `--device`, eager) and `bench_runner.run_batch` times each batch: identical
requests with forced lengths, first-frame step and time (TTFA without the codec), median step
time and audio seconds per second. One JSON line per (tp, batch).
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from bench.talker_runners import SENTENCE, run_batch
from stages.models.delay.config import DelayConfig
from stages.models.delay.processor import DelayProcessor
from stages.models.delay.runner import DelayRunner
from stages.models.delay.tp_runner import start_delay_tp
from stages.runtime.attention.backends import make_attention
from stages.runtime.checkpoint import read_config
from stages.runtime.tokenizer import TextTokenizer
from stages.workers.tp_ranks import tp_devices


def make_runner(model_dir: str, tp: int, device: str, dtype: torch.dtype, max_running: int, blocks: int,
                attention: str, graphs: bool):
    """TP=1: a `DelayRunner` (backbone graphs when asked, on CUDA); TP>1: eager ranks."""
    if tp == 1:
        return DelayRunner.from_dir(model_dir, device=device, dtype=dtype, max_running=max_running,
                                    num_kv_blocks=blocks, attention=make_attention(attention, device),
                                    cuda_graphs=graphs)
    return start_delay_tp(model_dir, devices=tp_devices(device, tp), dtype=dtype, max_running=max_running,
                          num_kv_blocks=blocks, attention=attention)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Delay checkpoint directory (config, weights, tokenizer)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attention", default="auto", help="padded | triton | auto (stages.runtime.attention.backends.make_attention)")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="TP=1 without backbone CUDA graphs (TP>1 always runs eagerly)")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    config = DelayConfig.from_dict(read_config(args.model))
    prompt = DelayProcessor(TextTokenizer.from_dir(args.model), config).build_prompt(SENTENCE)
    max_running = max(args.batch)
    blocks = max_running * (-(-(len(prompt) + args.frames + 40) // 16))
    for tp in args.tp:
        runner = make_runner(args.model, tp, args.device, dtype, max_running, blocks, args.attention, args.graphs)
        try:
            for batch in args.batch:
                result = run_batch(runner, prompt, batch, args.frames)
                print(json.dumps({"tp": tp, "device": args.device, "dtype": str(dtype).removeprefix("torch."),
                                  "attention": args.attention, "graphs": runner.backbone_graph_path, **result}),
                      flush=True)
        finally:
            if hasattr(runner, "close"):
                runner.close()
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
