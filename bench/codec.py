"""Streaming-decode throughput of a random-weight codec: `python -m bench.codec [--size full]`.

Builds the codec from `full_size_v2_config()` (or v1 / tiny) with random weights (no real
checkpoint is reachable, and speed does not depend on the values), then for each batch of slots
decodes a first chunk of 1 frame and steady chunks of `--chunk` frames, and prints milliseconds per
call and audio seconds per wall second. It also checks on the same device that a chunked decode
equals the whole decode (fp32, tiny config).
"""

from __future__ import annotations

import argparse
import time

import torch

from stages.models.codec.config import CodecConfig, full_size_v1_config, full_size_v2_config, tiny_v1_config, tiny_v2_config
from stages.models.codec.loader import build_codec
from stages.models.codec.model import CodecModel
from stages.models.codec.streaming import StreamingDecoder
from stages.workers.common import attention_without_plans

CONFIGS = {("v2", "full"): full_size_v2_config, ("v2", "tiny"): tiny_v2_config,
           ("v1", "full"): full_size_v1_config, ("v1", "tiny"): tiny_v1_config}


def random_codec(cfg: CodecConfig, device: str, dtype: torch.dtype, seed: int = 0) -> CodecModel:
    """A codec with seeded random weights: linears N(0, 1/fan_in), norms 1/0, LayerScale 0.1, codebooks N(0, 1)."""
    model = build_codec(cfg, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale"):
                p.fill_(0.1)
            elif "norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                fan_in = p.shape[1] if "codebook" not in name else 1
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) / fan_in**0.5)
    return model


def check_exact(device: str, version: str) -> tuple[float, float]:
    """(max |chunked - whole|, RMS of whole) of a 40-frame tiny decode in chunks 1, 15, 15, 9 (fp32, no TF32)."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        cfg = CodecConfig.from_json(CONFIGS[(version, "tiny")]())
        model = random_codec(cfg, device, torch.float32)
        codes = torch.randint(0, 1024, (cfg.quantizer.num_quantizers, 1, 40), device=device)
        whole = model.decode(codes)
        decoder = StreamingDecoder(model, num_slots=2, max_chunk_frames=15)
        parts, begin = [], 0
        for n in (1, 15, 15, 9):
            parts.append(decoder.decode(codes[:, :, begin: begin + n], torch.tensor([1])))
            begin += n
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    return (torch.cat(parts, dim=-1) - whole).abs().max().item(), whole.pow(2).mean().sqrt().item()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench(model: CodecModel, batch: int, chunk: int, n_vq: int, iters: int, device: str) -> tuple[float, float]:
    """(ms of the first 1-frame call, ms per steady `chunk`-frame call) for `batch` slots."""
    decoder = StreamingDecoder(model, num_slots=batch, max_chunk_frames=chunk)
    slots = torch.arange(batch)
    codes = torch.randint(0, 1024, (n_vq, batch, chunk), device=device)
    for _ in range(2):  # warm-up: kernels, allocator
        decoder.reset(slots)
        decoder.decode(codes[:, :, :1], slots)
        decoder.decode(codes, slots)
    decoder.reset(slots)
    sync(device)
    t0 = time.perf_counter()
    decoder.decode(codes[:, :, :1], slots)
    sync(device)
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    for _ in range(iters):
        decoder.decode(codes, slots)
    sync(device)
    return first_ms, (time.perf_counter() - t0) * 1e3 / iters


def bench_graph(model: CodecModel, batch: int, chunk: int, n_vq: int, iters: int, device: str) -> float:
    """ms per steady `chunk`-frame call replayed from one captured CUDA graph (a lead for GPU work)."""
    decoder = StreamingDecoder(model, num_slots=batch, max_chunk_frames=chunk)
    slots = torch.arange(batch, device=device)
    codes = torch.randint(0, 1024, (n_vq, batch, chunk), device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            decoder.decode(codes, slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.decode(codes, slots)
    graph.replay()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


def bench_grid(model: CodecModel, batches: list[int], chunks: list[int], n_vq: int, iters: int,
               device: str) -> dict[tuple[int, int], float]:
    """ms per graph replay of every (batch, chunk frames): what one codec dispatch of that shape
    costs, to fit a fixed cost per replay plus a cost per decoded frame-row."""
    return {(b, t): bench_graph(model, b, t, n_vq, iters, device) for b in batches for t in chunks}


KERNEL_BINS_US = (5.0, 10.0, 20.0, 50.0, 100.0)  # upper edges of the kernel-duration bins


def duration_bins(durations_us: list[float], edges: tuple[float, ...] = KERNEL_BINS_US) -> str:
    """Kernels by duration: how many and how much time fall under each edge (and above the last).
    A call of thousands of kernels of a few microseconds each is bound by their count (fusing
    them is the lever); one of a few long kernels by their work."""
    total = sum(durations_us)
    lines = [f"{len(durations_us)} kernels, {total / 1e3:.2f} ms of kernel time"]
    lower = 0.0
    for upper in (*edges, float("inf")):
        inside = [d for d in durations_us if lower <= d < upper]
        label = f"{lower:g}-{upper:g} us" if upper != float("inf") else f">= {lower:g} us"
        share = sum(inside) / total if total else 0.0
        lines.append(f"  {label:>12}: {len(inside):6d} kernels, {sum(inside) / 1e3:8.2f} ms ({share:.0%})")
        lower = upper
    return "\n".join(lines)


def profile_step(model: CodecModel, batch: int, chunk: int, n_vq: int, device: str) -> str:
    """Kernel-time table of one steady chunk (torch.profiler), to see where decode time goes; on
    CUDA also its kernels by duration (`duration_bins`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    decoder = StreamingDecoder(model, num_slots=batch, max_chunk_frames=chunk)
    slots = torch.arange(batch, device=device)
    codes = torch.randint(0, 1024, (n_vq, batch, chunk), device=device)
    for _ in range(2):
        decoder.decode(codes, slots)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        decoder.decode(codes, slots)
        sync(device)
    key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25)
    if not device.startswith("cuda"):
        return table
    kernels = [e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA]
    return f"{table}\n{batch} rows x {chunk} frames: {duration_bins(kernels)}"


def parse_mix(text: str) -> list[int]:
    """A dispatch's chunk lengths from "FRAMESxCOUNT,...": "1x5,15x7" -> [1] * 5 + [15] * 7."""
    lengths = []
    for part in text.split(","):
        frames, count = part.split("x")
        lengths += [int(frames)] * int(count)
    return lengths


def bench_dispatch(model: CodecModel, lengths: list[int], n_vq: int, iters: int, device: str,
                   split: bool) -> tuple[float, list[tuple[int, int]]]:
    """(ms per dispatch, its calls as (rows, frames)) of one codec dispatch of chunks of these
    lengths through a `CodecRunner` as the worker serves it (graphs on CUDA, eager graph logic
    elsewhere; the cost model calibrated first; chunks cut into shorter replays with `split`)."""
    from stages.models.codec.runner import CodecRunner

    cuda = device.startswith("cuda")
    # as many slots as frames: a call may hold one row per frame (the server's cap is codec.max_slots)
    runner = CodecRunner(model, n_vq=n_vq, max_slots=max(sum(lengths), 2), max_chunk_frames=max(lengths),
                         cuda_graphs=cuda, graphs_eager=not cuda, split_chunks=split)
    runner.call_frames = tuple(sorted(set(lengths)))  # as the worker's capture sets them: the schedule's
    if cuda:
        runner.calibrate()
    gen = torch.Generator().manual_seed(0)
    items = [(rid, torch.randint(0, 1024, (n, n_vq), generator=gen).numpy()) for rid, n in enumerate(lengths)]
    for rid, _ in items:
        runner.open(rid)
    for _ in range(2):  # graphs recorded on first use, then warm
        runner.decode(items)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        runner.decode(items)
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters, list(runner.last_calls)


def bench_encode(model: CodecModel, batch: int, seconds: float, n_vq: int, iters: int, device: str) -> tuple[float, float]:
    """(ms eager, ms replayed from the encode graphs) of `batch` reference clips of `seconds`."""
    from stages.models.codec.encode_graphs import EncodeGraphs

    cfg = model.cfg
    wavs = [torch.randn(cfg.channels, int(seconds * cfg.sampling_rate)) * 0.3 for _ in range(batch)]
    stacked = torch.stack(wavs).to(device)
    lengths = torch.full((batch,), stacked.shape[-1], device=device)
    graphs = EncodeGraphs(model, n_vq=n_vq, max_batch=batch, capture=device.startswith("cuda"))
    times = []
    for run in (lambda: model.encode(stacked, lengths, n_vq), lambda: graphs.encode(wavs)):
        run()
        run()  # warm-up (and the capture)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3 / iters)
    return times[0], times[1]


def add_codec_arguments(parser: argparse.ArgumentParser) -> None:
    """Which random-weight codec a codec bench builds, and where: --version, --size, --device,
    --dtype, --n-vq."""
    parser.add_argument("--version", choices=["v1", "v2"], default="v2")
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--n-vq", type=int, default=12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_codec_arguments(parser)
    parser.add_argument("--chunk", type=int, default=15)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--graphs", action="store_true", help="also time CUDA-graph replay of the steady chunk")
    parser.add_argument("--profile", action="store_true", help="print a kernel profile of one chunk at the last batch")
    parser.add_argument("--compile", action="store_true",
                        help="run the codec's layers through torch.compile (CodecModel.compile_layers)")
    parser.add_argument("--ring-attention", action="store_true",
                        help="streaming decode attends over the rings in place (CodecModel.use_ring_attention)")
    parser.add_argument("--fused-writes", action="store_true",
                        help="with --ring-attention: RoPE and the ring writes in one kernel a layer")
    parser.add_argument("--gelu-epilogue", action="store_true",
                        help="the decoder's FFN GELU (tanh) in the first matmul's epilogue (codec.gelu_epilogue)")
    parser.add_argument("--fused-norms", action="store_true",
                        help="with --fused-writes: each residual add and the LayerNorm after it in one kernel")
    parser.add_argument("--fused-attention", action="store_true",
                        help="with --fused-writes: the ring attention in the ring writes' kernel")
    parser.add_argument("--ring-attention-max-frames", type=int, default=None, metavar="N",
                        help="with --ring-attention: only chunks of at most N frames attend in place")
    parser.add_argument("--grid", default="",
                        help="chunk lengths (e.g. 1,2,4,8,15): graph replay ms of each (batch, length)")
    parser.add_argument("--dispatch", default="", metavar="MIX",
                        help='one codec dispatch of this chunk mix ("FRAMESxCOUNT,...", e.g. '
                             '1x5,2x5,4x5,8x5,15x7) through the runner as served: ms padded, and '
                             'with its chunks cut into shorter replays (codec.split_chunks)')
    parser.add_argument("--encode", action="store_true",
                        help="also time reference encoding of 6 s clips at each batch, eager vs encode graphs")
    args = parser.parse_args()
    attention_without_plans()  # the kernels the codec worker runs

    err, rms = check_exact(args.device, args.version)
    print(f"exactness on {args.device}: max |chunked - whole| = {err:.3g}, output RMS {rms:.3g} (tiny, fp32)")
    cfg = CodecConfig.from_json(CONFIGS[(args.version, args.size)]())
    model = random_codec(cfg, args.device, getattr(torch, args.dtype))
    if args.compile:
        model.compile_layers()
    if args.ring_attention:
        model.use_ring_attention(args.ring_attention_max_frames, fused_writes=args.fused_writes,
                                 fused_norms=args.fused_norms, fused_attention=args.fused_attention)
    model.use_gelu_epilogue(args.gelu_epilogue)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.version} {args.size} codec, {params / 1e9:.3f} B parameters, {args.dtype}, random weights"
          f"{', compiled layers' if args.compile else ''}{', ring attention in place' if args.ring_attention else ''}"
          f"{', fused ring writes' if args.ring_attention and args.fused_writes else ''}"
          f"{', fused residual norms' if args.ring_attention and args.fused_norms else ''}"
          f"{', ring attention fused with the ring writes' if args.ring_attention and args.fused_attention else ''}"
          f"{', GELU (tanh) in the first FFN matmul' if args.gelu_epilogue else ''}"
          f"{f' (chunks up to {args.ring_attention_max_frames} frames)' if args.ring_attention and args.ring_attention_max_frames else ''}")
    frame_s = cfg.downsample_rate / cfg.sampling_rate
    for batch in (int(b) for b in args.batches.split(",")):
        first_ms, step_ms = bench(model, batch, args.chunk, args.n_vq, args.iters, args.device)
        rate = batch * args.chunk * frame_s / (step_ms / 1e3)
        print(f"batch {batch:4d}: first 1-frame chunk {first_ms:8.1f} ms | {args.chunk}-frame chunk "
              f"{step_ms:8.1f} ms | {rate:8.1f} audio-s/s")
        if args.graphs:
            graph_ms = bench_graph(model, batch, args.chunk, args.n_vq, args.iters, args.device)
            rate = batch * args.chunk * frame_s / (graph_ms / 1e3)
            print(f"batch {batch:4d}: CUDA graph replay, {args.chunk}-frame chunk {graph_ms:8.1f} ms | {rate:8.1f} audio-s/s")
        if args.encode:
            eager_ms, graph_ms = bench_encode(model, batch, 6.0, args.n_vq, args.iters, args.device)
            print(f"batch {batch:4d}: encode 6 s clips eager {eager_ms:8.1f} ms | graphs {graph_ms:8.1f} ms "
                  f"({eager_ms / graph_ms:.2f}x)")
    if args.grid:
        batches = [int(b) for b in args.batches.split(",")]
        chunks = [int(t) for t in args.grid.split(",")]
        grid = bench_grid(model, batches, chunks, args.n_vq, args.iters, args.device)
        print("graph replay ms, rows = batch, columns = chunk frames: " + " ".join(f"{t:>8d}" for t in chunks))
        for b in batches:
            print(f"  batch {b:4d}: " + " ".join(f"{grid[(b, t)]:8.2f}" for t in chunks))
    if args.dispatch:
        lengths = parse_mix(args.dispatch)
        frames = sum(lengths) * frame_s
        timed = {split: bench_dispatch(model, lengths, args.n_vq, args.iters, args.device, split)
                 for split in (False, True)}
        for split, (ms, calls) in timed.items():
            print(f"dispatch {args.dispatch} ({len(lengths)} chunks, {sum(lengths)} frames), "
                  f"{'cut into rows' if split else 'padded'}: {ms:8.2f} ms, calls (rows, frames) {calls}, "
                  f"{frames / (ms / 1e3):8.1f} audio-s/s")
        print(f"cut / padded: {timed[True][0] / timed[False][0]:.3f}x the time")
    if args.profile:
        print(profile_step(model, batch, args.chunk, args.n_vq, args.device))


if __name__ == "__main__":
    main()
