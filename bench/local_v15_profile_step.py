"""Where the time of one steady-state Local-v1.5 decode step goes (full size, random bf16 weights).

    python -m bench.local_v15_profile_step --batch 1 128 [--context 300] [--eager]
        [--attention padded triton] [--compile] [--top 12] [--prefill 40 --prefill-seqs 6 --mixed 256]

For each batch B: B requests with `--context`-row prompts are prefilled, then decode steps are
replayed from the runner's CUDA graphs; it prints the median step, the local loop + sampling
alone (the runner's frame graph on the same hidden states) and, from `torch.profiler` over a few
replays, the kernels grouped by name (the whole step's, then the frame graph's alone): time per
step, share, launches per step; after each table, one period in launch order (a backbone layer,
a local position: `--layer-anchor`, `--position-anchor`), every kernel with the idle gap before it. Attention kernels are chosen as in the server's workers (no
cuDNN, `stages.workers.common.attention_without_plans`). The weights are random: the figures
measure the machinery, not speech.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch

from speech.sampling import SamplingParams
from stages.models.local_v15.config import full_size_config
from stages.models.local_v15.loader import build_talker_module
from stages.models.local_v15.runner import LocalV15Runner
from stages.models.qwen3 import fuse_projections
from stages.workers.common import attention_without_plans


def _median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def kernel_table(fn, steps: int, top: int = 25, period: str | None = None) -> str:
    """Kernels of `steps` calls of fn grouped by name: ms per step, share, launches per step;
    with `period`, then every kernel of one period in launch order (`kernel_period`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    kernels = []  # (name, start us, duration us)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            total[ev.name] += us
            count[ev.name] += 1
            kernels.append((ev.name, ev.time_range.start, us))
    all_us = sum(total.values())
    lines = [f"  kernel time per step {all_us / steps / 1e3:.2f} ms, launches per step {sum(count.values()) / steps:.0f}"]
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / steps / 1e3:8.3f} ms {100 * us / all_us:5.1f}% x{count[name] / steps:5.0f}  {name[:110]}")
    if period:
        lines.append(kernel_period(kernels, period))
    return "\n".join(lines)


def kernel_period(kernels: list[tuple[str, float, float]], anchor: str, which: int = 2) -> str:
    """One period of a repeating kernel sequence, in launch order: from the `which`-th kernel
    whose name contains `anchor` to the next one (a backbone layer from one paged attention
    launch to the next; a local position from one of its kernels to the next), each kernel with
    the idle gap before it and its duration, then the period's launches, kernel time and gaps.
    `kernels`: (name, start us, duration us) of a profile, in any order."""
    ordered = sorted(kernels, key=lambda k: k[1])
    starts = [i for i, k in enumerate(ordered) if anchor in k[0]]
    if len(starts) <= which:
        return f"  one period from {anchor!r}: fewer than {which + 1} launches of it"
    period = ordered[starts[which]:starts[which + 1]]
    lines = [f"  one period from {anchor!r} (its launch {which}), in launch order: gap before, duration, kernel"]
    gaps = busy = 0.0
    end = period[0][1]
    for name, start, dur in period:
        gap = max(0.0, start - end)  # kernels that overlap (other streams) count no gap
        gaps, busy, end = gaps + gap, busy + dur, max(end, start + dur)
        lines.append(f"    {gap:7.2f} us {dur:7.2f} us  {name[:100]}")
    gaps += max(0.0, ordered[starts[which + 1]][1] - end)  # before the next period's first launch
    lines.append(f"  the period: {len(period)} launches, {busy:.1f} us of kernels, {gaps:.1f} us between them")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--context", type=int, default=300, help="prompt rows per request")
    ap.add_argument("--steps", type=int, default=3, help="graph replays profiled")
    ap.add_argument("--top", type=int, default=12, help="kernel names listed per table")
    ap.add_argument("--eager", action="store_true", help="also time the eager (no graphs) step")
    ap.add_argument("--attention", nargs="+", default=["padded", "triton"],
                    help="attention backends to compare (stages.runtime.attention.backends.make_attention names)")
    ap.add_argument("--compile", action="store_true", help="last, also with the talker's torch.compile hot paths")
    ap.add_argument("--compile-mode", default=None, metavar="MODE",
                    help="torch.compile's mode for them (e.g. max-autotune-no-cudagraphs: matmul templates "
                         "timed against cuBLAS while compiling)")
    ap.add_argument("--compiled-only", action="store_true", help="with --compile, only the compiled variant")
    ap.add_argument("--prefill", type=int, nargs="*", default=[],
                    help="also time a step that prefills one new prompt of this many rows next to the B "
                         "decoding requests, and profile it (host and device time by op)")
    ap.add_argument("--prefill-seqs", type=int, default=1,
                    help="prompts of --prefill rows each that a probe step prefills at once")
    ap.add_argument("--prefill-graphs", action="store_true", help="prefill chunks replay PrefillGraphs")
    ap.add_argument("--fused-sampling", action="store_true",
                    help="each head samples in one Triton kernel (talker.fused_sampling)")
    ap.add_argument("--local-attention", choices=["sdpa", "plain", "kernel"], default="sdpa",
                    help="how the local steps attend (talker.local_attention)")
    ap.add_argument("--fused-projections", action="store_true",
                    help="each backbone layer's q/k/v and gate/up as one matmul each (talker.fused_projections)")
    ap.add_argument("--fused-kv-writes", action="store_true",
                    help="each backbone layer's KV stores inside its compiled first half (talker.fused_kv_writes)")
    ap.add_argument("--qk-rope-store", action="store_true",
                    help="each backbone layer's q/k norms, RoPE and KV stores in one Triton kernel "
                         "(talker.fused_qk_rope_store)")
    ap.add_argument("--deferred-residuals", action="store_true",
                    help="with --qk-rope-store, each layer's residual sums in the next norm's kernel "
                         "(talker.deferred_residuals)")
    ap.add_argument("--fp8", choices=["none", "backbone", "all"], default="none",
                    help="matmuls from float8 weights (talker.fp8_weights)")
    ap.add_argument("--fp8-scheme", choices=["w8a16", "w8a8"], default="w8a16",
                    help="how the float8 matmuls multiply (talker.fp8_scheme)")
    ap.add_argument("--fp8-swiglu", action="store_true",
                    help="w8a8: the MLPs' SiLU product quantized by one kernel (talker.fp8_fused_swiglu)")
    ap.add_argument("--fp8-scales", action="store_true",
                    help="w8a8: q|k|v's and down's scales in the kernels after them (talker.fp8_fused_scales)")
    ap.add_argument("--fp8-norms", action="store_true",
                    help="w8a8: each residual sum, norm and row quantization in one kernel (talker.fp8_fused_norms)")
    ap.add_argument("--kv-fp8", action="store_true", help="a float8 KV cache (talker.kv_cache_dtype: fp8)")
    ap.add_argument("--decode-splits", type=int, default=None, metavar="N",
                    help="the Triton attention splits every decode row's keys N ways (flash-decoding), "
                         "not as many as its shapes pick (none at 44-128 rows)")
    ap.add_argument("--overlap", action="store_true",
                    help="each step launched before the one before is read back (talker.overlap_steps): "
                         "a step's time is then the longer of its host and GPU parts")
    ap.add_argument("--mixed", type=int, default=0, metavar="TOKENS",
                    help="a step's decode rows and up to this many prompt tokens replay one mixed graph "
                         "(talker.mixed_step_tokens; the probes of --prefill take that path when they fit)")
    ap.add_argument("--layer-anchor", default="_paged_attention_kernel", metavar="NAME",
                    help="after the step's table, one backbone layer's kernels in launch order, from one "
                         "launch of a kernel named so to the next ('' for none)")
    ap.add_argument("--position-anchor", default="silu", metavar="NAME",
                    help="after the frame graph's table, one local position's kernels the same way")
    args = ap.parse_args(argv)
    attention_without_plans()  # as the server's workers
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_talker_module(full_size_config()).to(torch.bfloat16).eval()
    model.local_transformer.attend_plainly(args.local_attention == "plain")
    model.local_transformer.attend_by_kernel(args.local_attention == "kernel")
    if args.fused_projections:
        fuse_projections(model.transformer)
    model.use_fp8_weights(args.fp8, args.fp8_scheme)
    model.transformer.use_fp8_swiglu(args.fp8_swiglu)
    model.transformer.store_kv_in_layers(args.fused_kv_writes)
    model.transformer.store_kv_by_kernel(args.qk_rope_store)
    model.transformer.defer_residuals(args.deferred_residuals)
    model.transformer.use_fp8_scales_later(args.fp8_scales)
    model.transformer.use_fp8_norms(args.fp8_norms)
    rng = np.random.default_rng(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, random full-size bf16 talker", flush=True)
    variants = [] if args.compile and args.compiled_only else [(name, False) for name in args.attention]
    variants += [(args.attention[-1], True)] if args.compile else []
    for name, compiled in variants:
        if compiled:
            t0 = time.perf_counter()
            model.compile_hot_paths(mode=args.compile_mode)
        for B in args.batch:
            for graphs in ([True, False] if args.eager and not compiled else [True]):
                run_one(model, B, args, name, compiled, graphs, rng)
        if compiled:
            print(f"(compiled variant, including compilation on first use: {time.perf_counter() - t0:.0f} s)")


def run_one(model, B: int, args, attention: str, compiled: bool, graphs: bool, rng) -> None:
    from stages.runtime.attention.backends import make_attention
    from stages.runtime.attention.triton_paged import TritonPagedAttention

    cfg = model.config
    backend = make_attention(attention, "cuda")
    if args.decode_splits is not None and isinstance(backend, TritonPagedAttention):
        backend = TritonPagedAttention(num_splits=args.decode_splits)
    spare = sum(p // 16 + 2 for p in args.prefill) * args.prefill_seqs  # blocks of the prefill probes
    r = LocalV15Runner(model, max_running=B + args.prefill_seqs, num_kv_blocks=B * (args.context // 16 + 8) + spare,
                       prefill_chunk_tokens=4096, max_prefill_tokens_per_step=B * args.context,
                       cuda_graphs=graphs, attention=backend,
                       prefill_graphs=graphs and args.prefill_graphs, mixed_step_tokens=args.mixed,
                       fused_sampling=args.fused_sampling, overlap_steps=args.overlap,
                       kv_cache_dtype=torch.float8_e4m3fn if args.kv_fp8 else None)
    for i in range(B):
        p = np.full((args.context, 1 + cfg.n_vq), cfg.audio_pad_code, np.int64)
        p[:, 0] = rng.integers(0, 150000, args.context)
        r.add(i, p, SamplingParams(seed=i, forced_frames=10_000, max_new_frames=10_000))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r.step()  # prefill of every prompt (B x context rows) + first frames
    torch.cuda.synchronize()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        r.step()  # capture
    step_ms = _median_ms(r.step, 10)
    tag = f"B={B:4d} attention={attention:7s} compile={compiled!s:5} graphs={graphs!s:5}"
    tag += " fused-sampling" if args.fused_sampling else ""
    tag += {"plain": " plain-local", "kernel": " kernel-local"}.get(args.local_attention, "")
    tag += " overlap" if args.overlap else ""
    tag += " fused-projections" if args.fused_projections else ""
    tag += " fused-kv-writes" if args.fused_kv_writes else ""
    tag += " qk-rope-store" if args.qk_rope_store else ""
    tag += " deferred-residuals" if args.deferred_residuals else ""
    tag += f" fp8-{args.fp8}-{args.fp8_scheme}" if args.fp8 != "none" else ""
    tag += " fp8-swiglu" if args.fp8_swiglu else ""
    tag += " fp8-scales" if args.fp8_scales else ""
    tag += " fp8-norms" if args.fp8_norms else ""
    tag += " kv-fp8" if args.kv_fp8 else ""
    tag += f" compile-mode={args.compile_mode}" if args.compile_mode else ""
    tag += f" decode-splits-{args.decode_splits}" if args.decode_splits is not None else ""
    print(f"{tag} prefill {B}x{args.context} rows {prefill_ms:8.1f} ms | decode step {step_ms:7.2f} ms -> "
          f"{B * 0.08 / step_ms * 1e3:7.1f} audio-s/s", flush=True)
    if graphs and r.frame_graphs is not None:
        h = torch.randn(B, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        slots, frames = list(range(B)), [5] * B
        r.frame_graphs.run(h, slots, frames)
        local_ms = _median_ms(lambda: r.frame_graphs.run(h, slots, frames), 10)
        print(f"{tag} local loop + sampling alone (frame graph) {local_ms:7.2f} ms", flush=True)
        print(kernel_table(r.step, args.steps, top=args.top, period=args.layer_anchor), flush=True)
        print(f"{tag} the frame graph's kernels (local loop + sampling):", flush=True)
        print(kernel_table(lambda: r.frame_graphs.run(h, slots, frames), args.steps, top=args.top,
                           period=args.position_anchor), flush=True)
    for P in args.prefill:
        print(prefill_probe(r, P, tag, rng, args.prefill_seqs), flush=True)
    r = None  # frees the runner's KV pool and graphs before the next variant
    torch.cuda.empty_cache()


def prefill_probe(r: LocalV15Runner, rows: int, tag: str, rng, seqs: int = 1) -> str:
    """Median of steps that prefill `seqs` new `rows`-row prompts next to the running requests
    (they leave after their first frame), and the op tables of one such step: by self host time
    and by device time, to tell launch-bound from compute-bound prefill."""
    from torch.profiler import ProfilerActivity, profile

    cfg = r.model.config
    counter = iter(range(1_000_000, 2_000_000))

    def step() -> None:
        rids = [next(counter) for _ in range(seqs)]
        for rid in rids:
            p = np.full((rows, 1 + cfg.n_vq), cfg.audio_pad_code, np.int64)
            p[:, 0] = rng.integers(0, 150000, rows)
            r.add(rid, p, SamplingParams(seed=rid, forced_frames=10_000, max_new_frames=10_000))
        r.step()
        for rid in rids:
            r.remove(rid)

    for _ in range(2):
        step()  # any first-use compilation
    ms = _median_ms(step, 7)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    device = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    return f"{tag} step with {seqs} x {rows}-row prefill: {ms:7.2f} ms\n{host}\n{device}"


if __name__ == "__main__":
    main()
