"""Full-size random-weight Local-v1.5 talker on one GPU: prefill and decode-step timings.

    python -m bench.local_v15        # needs CUDA; prints the table of docs/performance-history.md, "Before the GPU work"

It first checks that tiny fp32 runs give the CPU codes on CUDA (both attention paths), then
times full-size bf16 prefill and decode steps (eager at B=1, CUDA graphs at B=64/256) and a
mixed steady state where finished streams are replaced at once (prefill next to decode).
The weights are random: the figures measure the machinery, not speech.
"""
import time

import numpy as np
import torch

from speech.sampling import SamplingParams
from stages.models.local_v15.config import full_size_config, tiny_config
from stages.models.local_v15.loader import build_talker_module
from stages.models.local_v15.model import GreedyFrameSampler
from stages.models.local_v15.runner import LocalV15Runner
from stages.runtime.attention.backends import PaddedBatchAttention, ReferenceAttention


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    # 1) tiny fp32: the same requests on CPU and CUDA give the same codes
    torch.manual_seed(0)
    tiny_cpu = build_talker_module(tiny_config()).eval()
    tiny_gpu = build_talker_module(tiny_config()).eval()
    tiny_gpu.load_state_dict(tiny_cpu.state_dict())
    tiny_gpu = tiny_gpu.cuda()
    rng = np.random.default_rng(0)
    reqs = {}
    for i in range(6):
        n = 20 + 7 * i
        p = np.full((n, 13), 1024, np.int64)
        p[:, 0] = rng.integers(0, 600, n)
        reqs[i] = (p, SamplingParams(seed=i, greedy=(i % 2 == 0), forced_frames=12))
    out = {}
    for name, m, backend in (("cpu", tiny_cpu, ReferenceAttention()), ("cuda-ref", tiny_gpu, ReferenceAttention()),
                             ("cuda-batched", tiny_gpu, PaddedBatchAttention())):
        r = LocalV15Runner(m, max_running=6, num_kv_blocks=64, prefill_chunk_tokens=16,
                           max_prefill_tokens_per_step=40, attention=backend)
        for rid, (p, sp) in reqs.items():
            r.add(rid, p, sp)
        codes = {rid: [] for rid in reqs}
        while r.num_running():
            for ev in r.step():
                if ev.codes is not None:
                    codes[ev.rid].append(ev.codes)
        out[name] = codes
    for name in ("cuda-ref", "cuda-batched"):
        same = sum(np.array_equal(np.array(out["cpu"][i]), np.array(out[name][i])) for i in reqs)
        print(f"tiny fp32 {name}: {same}/{len(reqs)} requests give the CPU codes exactly", flush=True)

    # 2) full size, bf16
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_talker_module(full_size_config()).to(torch.bfloat16).eval()
    cfg = model.config
    print("params", sum(p.numel() for p in model.parameters()), "GPU mem GiB",
          round(torch.cuda.memory_allocated() / 2**30, 2), flush=True)


    def prompt(n):
        p = np.full((n, 13), cfg.audio_pad_code, np.int64)
        p[:, 0] = rng.integers(0, 150000, n)
        p[-1, 0] = cfg.audio_start
        return p


    def bench(B, backend, prompt_len=200, frames=20, graphs=False):
        blocks = B * ((prompt_len + frames + 1) // 16 + 2)
        r = LocalV15Runner(model, max_running=B, num_kv_blocks=blocks, prefill_chunk_tokens=4096,
                           max_prefill_tokens_per_step=B * prompt_len, attention=backend, cuda_graphs=graphs)
        for i in range(B):
            r.add(i, prompt(prompt_len), SamplingParams(seed=i, forced_frames=frames))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r.step()
        torch.cuda.synchronize()
        t_prefill = time.perf_counter() - t0
        times = []
        while r.num_running():
            t0 = time.perf_counter()
            r.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        dec = float(np.median(times[2:]))
        # local loop alone (greedy, no sampling) at this batch
        h = torch.randn(B, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            model.decode_frame(h, GreedyFrameSampler())
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                model.decode_frame(h, GreedyFrameSampler())
            torch.cuda.synchronize()
        local = (time.perf_counter() - t0) / 5
        print(f"B={B:4d} {type(backend).__name__:22s} graphs={graphs!s:5} prefill {B}x{prompt_len} rows {t_prefill * 1e3:8.1f} ms | "
              f"decode step {dec * 1e3:7.1f} ms (local loop alone {local * 1e3:6.1f} ms) | "
              f"{B * 0.08 / dec:7.1f} audio-s/s", flush=True)


    bench(1, PaddedBatchAttention())  # warm-up
    for B in (64, 256):
        bench(B, PaddedBatchAttention(), graphs=True)


    def bench_mixed(B, prompt_len=200, steps=60):
        """Steady state: B streams, each finishing after 20-59 frames and replaced at once by a new request."""
        blocks = B * ((prompt_len + 64) // 16 + 2)
        r = LocalV15Runner(model, max_running=B, num_kv_blocks=blocks, prefill_chunk_tokens=512,
                           max_prefill_tokens_per_step=1024, cuda_graphs=True)
        nxt = 0

        def fill():
            nonlocal nxt
            while r.num_running() < B:
                r.add(nxt, prompt(prompt_len), SamplingParams(seed=nxt, forced_frames=20 + (nxt * 7) % 40))
                nxt += 1

        fill()
        for _ in range(40):  # reach steady state and capture the buckets
            r.step()
            fill()
        torch.cuda.synchronize()
        frames, t0 = 0, time.perf_counter()
        for _ in range(steps):
            frames += sum(ev.codes is not None for ev in r.step())
            fill()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"mixed steady state B={B}: {dt / steps * 1e3:.1f} ms/step, {frames * 0.08 / dt:.1f} audio-s/s "
              f"({frames} frames in {steps} steps)", flush=True)


    for B in (64, 128):
        bench_mixed(B)


if __name__ == "__main__":
    main()
