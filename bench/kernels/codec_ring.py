"""The codec's streaming attention alone, per decoder stage: `python -m bench.kernels.codec_ring`.

For each transformer stage of the decoder (its heads, head size, window and ring capacity) and
each chunk length, one layer's attention for a batch of slots, timed two ways:
- copy: the chunk's keys written into the rings, each row's ring copied out and SDPA with the
  window mask (`CausalWindowAttention.attend` with a copy-and-mask `WindowPlan`);
- in place: the same write, then the Triton kernel over the rings where they are
  (`ring_attention`), with its default tiles and with each configuration of `--tiles`.
It checks that every way gives the copy's output (max |difference| printed) and prints ms per
layer and, with the stage's layer count, ms per decode call: which path, and which tiles, make a
chunk of each length cheapest. Rings hold random keys at steady state (positions well past the
window). `--quick` runs a tiny stage on whatever device there is (the CPU runs the kernel in
Triton's interpreter, which must be enabled before triton is imported: TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from bench.kernels.timing import time_ms
from stages.models.codec.config import CodecConfig, TransformerStage
from stages.models.codec.streaming import ring_capacity
from stages.models.codec.transformer import CausalWindowAttention, LayerCache, WindowPlan

Tiles = tuple[int, int, int, int]  # block_m, block_n, num_warps, num_stages
DEFAULT_TILES = "32,64,4,2 64,64,4,2 64,64,8,3 128,64,8,3 64,128,8,3 128,32,8,2"


@dataclass
class StageResult:
    """One (stage, chunk frames) of the sweep: ms per layer of each way, and its max |error|."""

    stage: int
    layers: int
    tokens: int  # query positions of the chunk at this stage
    capacity: int
    copy_ms: float
    in_place_ms: float
    tiles_ms: dict[Tiles, float]
    max_error: float



def bench_stage(stage: TransformerStage, index: int, batch: int, frames: int, max_chunk_frames: int,
                tiles: list[Tiles], iters: int, device: torch.device, dtype: torch.dtype) -> StageResult:
    """One layer of `stage` for `batch` slots and a chunk of `frames` frames (module docstring)."""
    from stages.models.codec.ring_attention import ring_attention

    gen = torch.Generator(device=device).manual_seed(index * 100 + frames)
    H, Dh, T = stage.num_heads, stage.head_dim, frames * stage.tokens_per_frame
    C = ring_capacity(stage, max_chunk_frames)
    slots = torch.randperm(batch + 1, generator=gen, device=device)[:batch]  # [B] distinct, one spare
    start = 10 * C + torch.randint(0, C, (batch,), generator=gen, device=device)  # [B] steady state

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    cache = LayerCache(rand(batch + 1, C, H, Dh), rand(batch + 1, C, H, Dh))  # [S, C, H, Dh] each
    q, k, v = rand(batch, T, H, Dh), rand(batch, T, H, Dh), rand(batch, T, H, Dh)  # [B, T, H, Dh]
    attention = CausalWindowAttention(stage.d_model, H).to(device)
    copy_plan = WindowPlan.chunk(slots, start, T, stage, C, dtype)
    in_place_plan = WindowPlan.chunk(slots, start, T, stage, C, dtype, in_place=True)

    want = attention.attend(q, k, v, copy_plan, cache, slots).transpose(1, 2)  # [B, T, H, Dh]
    got = {None: attention.attend(q, k, v, in_place_plan, cache, slots).transpose(1, 2)}
    for t in tiles:
        got[t] = ring_attention(q, cache.k, cache.v, slots, start, stage.context, block_m=t[0], block_n=t[1],
                                num_warps=t[2], num_stages=t[3])
    error = max((out.float() - want.float()).abs().max().item() for out in got.values())

    copy_ms = time_ms(lambda: attention.attend(q, k, v, copy_plan, cache, slots), iters, device)
    in_place_ms = time_ms(lambda: attention.attend(q, k, v, in_place_plan, cache, slots), iters, device)
    write_ms = time_ms(lambda: (cache.k.view(-1, H * Dh).index_copy_(0, in_place_plan.rows, k.reshape(-1, H * Dh)),
                                cache.v.view(-1, H * Dh).index_copy_(0, in_place_plan.rows, v.reshape(-1, H * Dh))),
                       iters, device)
    tiles_ms = {t: write_ms + time_ms(lambda t=t: ring_attention(q, cache.k, cache.v, slots, start, stage.context,
                                                                block_m=t[0], block_n=t[1], num_warps=t[2],
                                                                num_stages=t[3]), iters, device)
                for t in tiles}
    return StageResult(index, stage.num_layers, T, C, copy_ms, in_place_ms, tiles_ms, error)


def parse_tiles(text: str) -> list[Tiles]:
    """"32,64,4,2 64,64,8,3" -> [(32, 64, 4, 2), (64, 64, 8, 3)]."""
    out = []
    for item in text.split():
        parts = tuple(int(x) for x in item.split(","))
        if len(parts) != 4:
            raise ValueError(f"tiles {item!r}: expected block_m,block_n,num_warps,num_stages")
        out.append(parts)
    return out


def report(results: list[StageResult], frames: int) -> list[str]:
    """Lines: per stage, ms per layer of each way; then ms per decode call (x layers), summed."""
    lines = [f"chunk of {frames} frame(s): ms per layer (x layers = per call)"]
    totals: dict[str, float] = {}
    for r in results:
        best_t, best = min(r.tiles_ms.items(), key=lambda kv: kv[1]) if r.tiles_ms else (None, float("nan"))
        lines.append(f"  stage {r.stage}: T {r.tokens:4d} C {r.capacity:4d} x {r.layers:2d} layers | copy {r.copy_ms:7.3f} "
                     f"| in place {r.in_place_ms:7.3f} | best tiles {best_t} {best:7.3f} | max err {r.max_error:.3g}")
        for name, ms in (("copy", r.copy_ms), ("in place", r.in_place_ms), ("best tiles", best)):
            totals[name] = totals.get(name, 0.0) + ms * r.layers
        for t, ms in r.tiles_ms.items():
            totals[f"tiles {t}"] = totals.get(f"tiles {t}", 0.0) + ms * r.layers
    lines.append("  per decode call: " + " | ".join(f"{k} {v:.2f} ms" for k, v in totals.items()))
    return lines


def main() -> None:
    from bench.codec import CONFIGS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--version", choices=["v1", "v2"], default="v2")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--frames", default="1,4,8,15", help="chunk lengths in frames")
    parser.add_argument("--max-chunk-frames", type=int, default=15, help="the rings' headroom (the longest chunk)")
    parser.add_argument("--tiles", default=DEFAULT_TILES,
                        help="kernel configurations to time: block_m,block_n,num_warps,num_stages ...")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="the tiny codec, batch 2, 1 iteration (a smoke run)")
    args = parser.parse_args()

    device = torch.device(args.device)
    size = "tiny" if args.quick else "full"
    cfg = CodecConfig.from_json(CONFIGS[(args.version, size)]())
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    batch, iters = (2, 1) if args.quick else (args.batch, args.iters)
    tiles = parse_tiles("16,16,4,1" if args.quick else args.tiles)
    stages = [s for s in cfg.decoder if isinstance(s, TransformerStage)]
    print(f"{args.version} {size} codec decoder, {len(stages)} transformer stages, batch {batch}, {dtype}")
    with torch.inference_mode():
        for frames in (int(f) for f in args.frames.split(",")):
            results = [bench_stage(s, i, batch, frames, args.max_chunk_frames, tiles, iters, device, dtype)
                       for i, s in enumerate(stages)]
            print("\n".join(report(results, frames)), flush=True)


if __name__ == "__main__":
    main()
