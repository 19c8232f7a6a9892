"""Talker-runner timing for the Delay variants and Realtime with random weights (no codec).

    python -m bench.talker_runners --variant moss-tts --size full --batch 1 16 64 --frames 50

Builds the talker at tiny or full size on the device with seeded N(0, 0.02) weights (norm weights
1), admits `batch` identical requests with `forced_frames` (random weights stop at random), and steps
the runner until all finish. Prints one JSON line per batch size: steps, frames, wall time, the
step and time of the first frame, the median step time and audio seconds per second (frames x
80 ms / wall). Random weights: the numbers measure the machinery, not speech quality.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from speech.sampling import SamplingParams
from stages.models.delay.config import DelayConfig, full_size_config, tiny_config
from stages.models.delay.model import DelayModel
from stages.models.delay.processor import DelayProcessor
from stages.models.delay.runner import DelayRunner
from stages.models.realtime.config import RealtimeConfig, full_size_config as realtime_full, tiny_config as realtime_tiny
from stages.models.realtime.model import RealtimeModel
from stages.models.realtime.processor import RealtimeProcessor
from stages.models.realtime.runner import RealtimeRunner
from stages.runtime.tokenizer import TextTokenizer

SENTENCE = "Hello world, this is a tiny golden test. " * 3


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def build(variant: str, size: str, tokenizer_dir: str, device: torch.device, dtype: torch.dtype):
    """(model, prompt, runner class) for `variant` at `size` with random weights."""
    tokenizer = TextTokenizer.from_dir(tokenizer_dir)
    if variant == "realtime":
        cfg = RealtimeConfig.from_dict(realtime_full() if size == "full" else realtime_tiny())
        with torch.device("meta"):
            model = RealtimeModel(cfg)
        model = randomize_(model.to_empty(device=device).to(dtype)).eval()
        return model, RealtimeProcessor(tokenizer, cfg).build_prompt(SENTENCE), RealtimeRunner
    cfg = DelayConfig.from_dict(full_size_config(variant) if size == "full" else tiny_config(n_vq=16))
    with torch.device("meta"):
        model = DelayModel(cfg)
    model = randomize_(model.to_empty(device=device).to(dtype)).fuse_().eval()
    return model, DelayProcessor(tokenizer, cfg).build_prompt(SENTENCE), DelayRunner


def run_batch(runner, prompt, batch: int, frames: int) -> dict:
    for rid in range(batch):
        runner.add(rid, prompt, SamplingParams(seed=rid, forced_frames=frames, max_new_frames=frames))
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    first, emitted, step_times = None, 0, []
    while runner.num_running():
        t = time.perf_counter()
        events = runner.step()  # ends with the step's one device-to-host copy
        step_times.append(time.perf_counter() - t)
        got = sum(e.codes is not None for e in events)
        if got and first is None:
            first = (len(step_times), time.perf_counter() - start)
        emitted += got
    wall = time.perf_counter() - start
    steady = sorted(step_times[2:] or step_times)
    return {"batch": batch, "steps": len(step_times), "frames": emitted, "wall_s": round(wall, 3),
            "first_frame_step": first[0], "first_frame_s": round(first[1], 3),
            "median_step_ms": round(steady[len(steady) // 2] * 1e3, 2),
            "audio_s_per_s": round(emitted * 0.08 / wall, 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="moss-tts",
                    choices=["moss-tts", "ttsd", "sound-effect", "voice-generator", "realtime"])
    ap.add_argument("--size", default="tiny", choices=["tiny", "full"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json (text ids only)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, prompt, runner_cls = build(args.variant, args.size, args.tokenizer, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    for batch in args.batch:
        blocks = batch * (-(-(len(prompt) + args.frames + 40) // 16))
        runner = runner_cls(model, max_running=batch, num_kv_blocks=blocks)
        result = run_batch(runner, prompt, batch, args.frames)
        print(json.dumps({"variant": args.variant, "size": args.size, "params": params, "device": str(device),
                          "dtype": str(dtype).removeprefix("torch."), **result}), flush=True)


if __name__ == "__main__":
    main()
