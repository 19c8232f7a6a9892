"""The codec's reference encoder alone: `python -m bench.encoder [--size full]`.

A new voice costs one encode of its reference clip. This times `CodecModel.encode` on a
random-weight codec (speed does not depend on the values) for batches of clips of `--seconds`:

- per mode (`eager`; `fused`: through the streaming kernels, `CodecModel.use_fused_encoder`;
  `compiled`: the encoder's layers through torch.compile; `graphs`: replayed from the encode
  graphs; `fused+graphs`: both): ms a batch, ms a clip, clip seconds encoded a second, and the model
  FLOP/s it reached (`encoder_flops`);
- `--profile`: one eager batch under the torch profiler: the GPU time of its kernels against the
  call's wall time (a call whose kernels take much less than its wall time waits on the host's
  launches), the kernel count, and the kernels that took most;
- `--beside`: what an encode on another thread does to a loop of small GPU calls on this one (a
  stand-in for the codec's decode loop, which shares its process, and so its interpreter lock,
  with the encoder thread): the loop's iteration time alone and beside each mode.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from bench.codec import CONFIGS, add_codec_arguments, random_codec, sync
from stages.models.codec.config import CodecConfig, TransformerStage
from stages.models.codec.model import CodecModel


def encoder_flops(cfg: CodecConfig, seconds: float) -> float:
    """Model FLOPs of encoding `seconds` of audio: every encoder stage's matmuls (projections,
    attention's q, k, v and output, the FFN) and its windowed attention scores and sums."""
    total = 0.0
    for stage in cfg.encoder:
        if not isinstance(stage, TransformerStage):
            continue
        n = stage.rate * seconds  # positions
        d, f = stage.d_model, stage.dim_feedforward
        per_layer = 2 * n * (4 * d * d + 2 * d * f) + 4 * n * min(stage.context, n) * d
        total += stage.num_layers * per_layer + 2 * n * d * (stage.input_dim + stage.output_dim)
    return total


def clips(cfg: CodecConfig, batch: int, seconds: float, device: str) -> tuple[list[torch.Tensor], torch.Tensor,
                                                                               torch.Tensor]:
    """`batch` clips of noise: host waveforms [channels, samples] each, stacked on the device
    [batch, channels, samples], lengths [batch]."""
    wavs = [torch.randn(cfg.channels, int(seconds * cfg.sampling_rate)) * 0.3 for _ in range(batch)]
    stacked = torch.stack(wavs).to(device)
    return wavs, stacked, torch.full((batch,), stacked.shape[-1], device=device)


def encoder_call(model: CodecModel, mode: str, batch: int, seconds: float, n_vq: int, device: str):
    """A no-argument call that encodes `batch` clips in `mode` (made and warmed up)."""
    wavs, stacked, lengths = clips(model.cfg, batch, seconds, device)
    if mode.endswith("graphs"):
        from stages.models.codec.encode_graphs import EncodeGraphs

        graphs = EncodeGraphs(model, n_vq=n_vq, max_batch=batch, lengths_s=(seconds,), capture=True)
        call = lambda: graphs.encode(wavs)  # noqa: E731
    else:
        call = lambda: model.encode(stacked, lengths, n_vq)  # noqa: E731
    for _ in range(2):  # kernels, compiles, the capture
        call()
    sync(device)
    return call


def time_call(call, iters: int, device: str) -> float:
    """ms a call, over `iters` calls."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


def kernel_profile(call, device: str, top: int) -> None:
    """One call under the profiler: its kernels' GPU time against its wall time, and the largest."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        call()
        sync(device)
        wall = (time.perf_counter() - t0) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.device_time for e in kernels) / 1e3
    print(f"  profile: wall {wall:.1f} ms (under the profiler), kernels {len(kernels)}, their GPU time {gpu:.1f} ms")
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time / 1e3)
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"    {sum(times):8.2f} ms {100 * sum(times) / max(gpu, 1e-9):5.1f}% {len(times):5d}x  {name[:110]}")


def small_loop(device: str, seconds: float) -> list[float]:
    """A decode loop's stand-in for `seconds`: each iteration 40 small launches and a sync; its
    iteration times in ms."""
    x = torch.randn(64, 1280, device=device)
    w = torch.randn(1280, 1280, device=device) / 1280**0.5
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        y = x
        for _ in range(20):
            y = torch.tanh(y @ w)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def beside(call, device: str, seconds: float) -> tuple[float, float, int]:
    """The small loop's iteration ms (p50, p99) while another thread encodes with `call` over and
    over (None: alone), and how many encodes ran."""
    stop, done = threading.Event(), [0]

    def encode_forever() -> None:
        stream = torch.cuda.Stream() if device.startswith("cuda") else None
        while not stop.is_set():
            if stream is not None:
                with torch.cuda.stream(stream):
                    call()
                stream.synchronize()
            else:
                call()
            done[0] += 1

    thread = threading.Thread(target=encode_forever, daemon=True) if call is not None else None
    if thread is not None:
        thread.start()
        time.sleep(0.2)
    times = small_loop(device, seconds)
    stop.set()
    if thread is not None:
        thread.join()
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))], done[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_codec_arguments(parser)
    parser.add_argument("--batches", default="1,8,16,32")
    parser.add_argument("--seconds", type=float, default=6.0, help="each clip's length")
    parser.add_argument("--modes", default="eager,fused,graphs,fused+graphs",
                        help="eager, fused (the streaming kernels), compiled (the encoder's layers through "
                             "torch.compile), graphs (CUDA), fused+graphs")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="a kernel profile of one call at each batch (not graphs)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--beside", type=float, default=0.0, metavar="S",
                        help="S seconds of a small GPU loop alone and beside each mode's encodes at the last batch")
    args = parser.parse_args()

    cfg = CodecConfig.from_json(CONFIGS[(args.version, args.size)]())
    batches = [int(b) for b in args.batches.split(",")]
    flop = encoder_flops(cfg, args.seconds)
    print(f"{args.version} {args.size} codec encoder, random weights, {args.dtype}, {args.seconds:g} s clips "
          f"({flop / 1e9:.0f} GFLOP a clip)")
    last_calls = {}
    for mode in args.modes.split(","):
        if mode.endswith("graphs") and not args.device.startswith("cuda"):
            continue
        model = random_codec(cfg, args.device, getattr(torch, args.dtype))
        if mode == "compiled":
            model.compile_layers(encoder=True, decoder=False)
        model.use_fused_encoder(mode.startswith("fused"))
        for batch in batches:
            t0 = time.perf_counter()
            call = encoder_call(model, mode, batch, args.seconds, args.n_vq, args.device)
            made = time.perf_counter() - t0
            ms = time_call(call, args.iters, args.device)
            print(f"{mode:>8} batch {batch:3d}: {ms:8.1f} ms a batch, {ms / batch:6.2f} ms a clip, "
                  f"{batch * args.seconds / (ms / 1e3):7.0f} clip-s/s, {batch * flop / (ms / 1e3) / 1e12:6.1f} TFLOP/s "
                  f"(made in {made:.1f} s)", flush=True)
            if args.profile and not mode.endswith("graphs"):
                kernel_profile(call, args.device, args.top)
            last_calls[mode] = call
    if args.beside:
        p50, p99, _ = beside(None, args.device, args.beside)
        print(f"small loop alone: {p50:.2f} ms p50, {p99:.2f} ms p99 an iteration")
        for mode, call in last_calls.items():
            p50, p99, n = beside(call, args.device, args.beside)
            print(f"small loop beside {mode} encodes of batch {batches[-1]}: {p50:.2f} ms p50, {p99:.2f} ms p99 "
                  f"({n} encodes in {args.beside:g} s)")


if __name__ == "__main__":
    main()
