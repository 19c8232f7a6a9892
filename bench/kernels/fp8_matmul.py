"""The talker's matmuls from float8 weights against bf16, alone: `python -m bench.kernels.fp8_matmul`.

For each of the Local-v1.5 talker's weight shapes (the backbone's fused q/k/v, o, fused gate/up
and down projections, and the local block's four) at each row count of `--rows` (a decode step's
rows; 344 is a mixed step's 256 prompt tokens beside 88 rows), two ways of one product in
bf16: `F.linear` on the bf16 weights (cuBLAS) and `w8a16_mm` on float8 weights (the Triton
kernel of `talker.fp8_scheme: w8a16`; the w8a8 scheme's cuBLAS products: `bench.kernels.fp8_cublas`).
Each is timed as a CUDA graph of `--iters` calls (no host launch cost), and
printed with the rate at which it read its weights and its time against bf16's. The last lines
add one decode step's matmuls up (36 backbone layers, the local block 12 times a frame). With
`--sweep ROWS...` each shape is first run at each ROWS rows over a grid of launch
configurations around `plan`'s (channels and inputs a tile, input splits) and the fastest three are printed against
`plan`'s own: what to change in `plan` if a shape is slow. `--quick` runs one tiny shape on the
CPU through Triton's interpreter (TRITON_INTERPRET=1 before triton is imported): the code path,
not a time.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.kernels.timing import graph_us
from stages.runtime.fp8_linear import quantize_rows
from stages.runtime.fp8_matmul import MIN_SPLIT_K, launch, plan, w8a16_mm

# (name, out channels, in channels, times a decode step): Local-v1.5 full size
SHAPES = (("qkv", 6144, 2560, 36), ("o", 2560, 4096, 36), ("gate_up", 19456, 2560, 36), ("down", 2560, 9728, 36),
          ("local c_attn", 7680, 2560, 12), ("local c_proj", 2560, 2560, 12), ("local fc_in", 9728, 2560, 12),
          ("local fc_out", 2560, 9728, 12))
QUICK_SHAPES = (("tiny", 64, 1024, 1),)


def sweep(rows: int, iters: int, dev: torch.device, shapes=SHAPES) -> None:
    """Per shape at `rows` rows: the fastest launch configurations of a grid around `plan`'s."""
    for name, n, k, _ in shapes:
        w_fp8, w_scale = quantize_rows(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
        scale = w_scale.reshape(-1).contiguous()
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        base = plan(rows, n, k)
        bm, _, _, split, warps, stages = base
        configs = {base}
        # wider channel tiles read each row tile of x from L2 fewer times per weight byte (x's
        # tile is BLOCK_M x BLOCK_K bf16 beside BLOCK_N x BLOCK_K float8 of weights)
        for bn in (32, 64, 128, 256):
            for bk in (64, 128, 256):
                for s in {max(1, split // 2), split, split * 2, split * 4}:
                    if k // s >= MIN_SPLIT_K // 2:
                        configs.add((bm, bn, bk, s, 8 if bn == 256 else warps, stages))
        timed = []
        for config in sorted(configs):
            try:
                us = graph_us(lambda: launch(x, w_fp8, scale, config), iters)
                timed.append((us, config))
            except Exception as e:  # a tile too large for the SM's shared memory: skipped
                print(f"  {name} {config}: {type(e).__name__}", flush=True)
        timed.sort()
        mine = next(t for t, c in timed if c == base)
        best = " ; ".join(f"{c} {t:.1f} us" for t, c in timed[:3])
        print(f"sweep w8a16 {name:13s} {n:5d}x{k:<5d} rows {rows}: plan {base}"
              f" {mine:.1f} us ({n * k / mine / 1e3:.0f} GB/s) | fastest: {best}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 44, 88, 128, 344])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", type=int, nargs="*", default=[], metavar="ROWS", help="first, a tile sweep at each ROWS")
    ap.add_argument("--quick", action="store_true", help="one tiny shape on the CPU (Triton's interpreter)")
    args = ap.parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.quick:
        args.rows, args.iters = [3], 1
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (interpreter)"
    print(f"torch {torch.__version__}, {name}; us a call from a graph, GB/s of weights read")
    for rows in args.sweep:
        sweep(3 if args.quick else rows, args.iters, dev, shapes)
    step = {m: [0.0, 0.0] for m in args.rows}
    for name, n, k, per_step in shapes:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02  # [n, k]
        w_fp8, w_scale = quantize_rows(w)  # [n, k], [n, 1]
        scale_row = w_scale.reshape(-1).contiguous()
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

            ref = x.float() @ (w_fp8.float() * w_scale).t()
            err = ((w8a16_mm(x, w_fp8, scale_row).float() - ref).norm() / ref.norm()).item()
            times = [graph_us(lambda: F.linear(x, w), args.iters),
                     graph_us(lambda: w8a16_mm(x, w_fp8, scale_row), args.iters)]
            for i, t in enumerate(times):
                step[m][i] += t * per_step / 1e3
            bm, bn, bk, split, warps, stages = plan(m, n, k)
            print(f"{name:13s} {n:5d}x{k:<5d} rows {m:4d} | bf16 {times[0]:7.1f} us"
                  f" {n * k * 2 / times[0] / 1e3:5.0f} GB/s"
                  f" | w8a16 {times[1]:7.1f} us {n * k / times[1] / 1e3:5.0f} GB/s {times[1] / times[0]:5.2f}x"
                  f" (tile {bm}x{bn}x{bk}, split {split}, err {err:.1e})", flush=True)
    for m, (bf16, w8a16) in step.items():
        print(f"a decode step's matmuls at {m:4d} rows: bf16 {bf16:6.2f} ms, w8a16 {w8a16:6.2f} ms "
              f"({w8a16 / bf16:4.2f}x)")


if __name__ == "__main__":
    main()
