"""The few-row matmul kernel (`stages.runtime.rows_matmul`) alone against cuBLAS, at the talker's
shapes (full-size Local-v1.5: the backbone's fused projections and the local block's linears,
random bf16 weights).

    python -m bench.rows_matmul [--rows 16 48 88] [--iters 20] [--top 3]

Per shape and row count, each from CUDA graph replays of `--iters` launches that cycle through
enough copies of the weights (>= 400 MB) that none is read from L2, as in a step where every
layer reads its own: cuBLAS (`F.linear`, torch's default library, then cuBLASLt), the kernel as
`plan` picks its tiles (at most `MAX_ROWS` rows; more: one row tile, 64 x 64, unsplit;
split partials summed by torch, as eager calls run it), and the best
tiles of a sweep (block N x block K x stages x split, the kernel alone, partials unsummed: a
compiled layer fuses their sum with what follows). Microseconds a launch and the weights' TB/s.
CUDA only.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from bench.timing import graph_us
from stages.runtime import rows_matmul

# (name, inputs, outputs, bias): the talker's matmuls at full size
SHAPES = (
    ("backbone qkv", 2560, 6144, False),
    ("backbone o", 4096, 2560, False),
    ("backbone gate_up", 2560, 19456, False),
    ("backbone down", 9728, 2560, False),
    ("local c_attn", 2560, 7680, True),
    ("local c_proj", 2560, 2560, True),
    ("local fc_in", 2560, 9728, True),
    ("local fc_out", 9728, 2560, True),
)
ROTATE_BYTES = 400 << 20


def _rotating(fn_of, copies):
    """A call that uses the next copy each time (so a captured graph cycles through them)."""
    turn = itertools.count()
    return lambda: fn_of(*copies[next(turn) % len(copies)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 48, 88])
    ap.add_argument("--iters", type=int, default=20, help="launches a CUDA graph times")
    ap.add_argument("--top", type=int, default=3, help="best sweep tiles printed a shape")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}: x [rows, K] @ W [N, K]^T, bf16, us a launch (weights' TB/s)")
    for name, k, n, has_bias in SHAPES:
        wbytes = n * k * 2
        copies = [(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5,
                   torch.randn(n, device=dev, dtype=torch.bfloat16) if has_bias else None)
                  for _ in range(max(2, -(-ROTATE_BYTES // wbytes)))]
        tbs = lambda us: wbytes / us / 1e6  # noqa: E731 - bytes a us -> TB/s
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            line = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                line[lib] = graph_us(_rotating(lambda w, b: F.linear(x, w, b), copies), args.iters)
            torch.backends.cuda.preferred_blas_library("cublas")
            block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
            config = rows_matmul.plan(m, n, k) if m <= rows_matmul.MAX_ROWS else (block_m, 64, 64, 1, 4, 5)
            line["plan"] = graph_us(_rotating(lambda w, b: rows_matmul.launch(x, w, b, config), copies), args.iters)
            want = F.linear(x, *copies[0]).float()
            got = rows_matmul.launch(x, *copies[0], config).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            swept = []
            for block_n, block_k, stages in itertools.product((32, 64, 128), (64, 128, 256), (3, 5)):
                if (block_n + block_m) * block_k * 2 * stages > 200 << 10:  # shared memory an SM
                    continue
                for split in (1, 2, 4, 8):
                    if k // split < block_k or k % (split * block_k):
                        continue
                    tiles = (block_m, block_n, block_k, split, 4 if block_n <= 64 else 8, stages)
                    us = graph_us(_rotating(lambda w, b, t=tiles: rows_matmul.launch(x, w, b, t, partials=True),
                                            copies), args.iters)
                    swept.append((us, tiles))
            swept.sort()
            print(f"{name:17s} {n:5d}x{k:<5d} rows {m:3d}: cuBLAS {line['cublas']:6.2f} ({tbs(line['cublas']):.2f}) "
                  f"cuBLASLt {line['cublaslt']:6.2f} ({tbs(line['cublaslt']):.2f}) | kernel as planned {config} "
                  f"{line['plan']:6.2f} ({tbs(line['plan']):.2f}), max error {err:.1e}")
            for us, tiles in swept[:args.top]:
                print(f"    swept (BLOCK_M, BLOCK_N, BLOCK_K, split, warps, stages) {tiles}: {us:6.2f} ({tbs(us):.2f})"
                      f" = {us / line['cublas']:.2f}x cuBLAS")


if __name__ == "__main__":
    main()
