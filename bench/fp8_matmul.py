"""The talker's matmuls from float8 weights against bf16, alone: `python -m bench.fp8_matmul`.

For each of the Local-v1.5 talker's weight shapes (the backbone's fused q/k/v, o, fused gate/up
and down projections, and the local block's four) at each row count of `--rows` (a decode step's
rows; 344 is a mixed step's 256 prompt tokens beside 88 rows), three ways of one product in
bf16: `F.linear` on the bf16 weights (cuBLAS, as served), `w8a16_mm` on float8 weights (the
Triton kernel of `talker.fp8_scheme: w8a16`) and the w8a8 scheme (rows quantized, then
`torch._scaled_mm`). Each is timed as a CUDA graph of `--iters` calls (no host launch cost), and
printed with the rate at which it read its weights and its time against bf16's. The last lines
add one decode step's matmuls up (36 backbone layers, the local block 12 times a frame).
CUDA only.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from stages.runtime.fp8_linear import quantize_rows
from stages.runtime.fp8_matmul import plan, w8a16_mm

# (name, out channels, in channels, times a decode step): Local-v1.5 full size
SHAPES = (("qkv", 6144, 2560, 36), ("o", 2560, 4096, 36), ("gate_up", 19456, 2560, 36), ("down", 2560, 9728, 36),
          ("local c_attn", 7680, 2560, 12), ("local c_proj", 2560, 2560, 12), ("local fc_in", 9728, 2560, 12),
          ("local fc_out", 2560, 9728, 12))


def graph_us(fn, iters: int) -> float:
    """Mean us of `fn` replayed from one CUDA graph of `iters` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / (5 * iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 44, 88, 128, 344])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; us a call from a graph, GB/s of weights read")
    step = {m: [0.0, 0.0, 0.0] for m in args.rows}
    for name, n, k, per_step in SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        w_fp8, w_scale = quantize_rows(w)  # [n, k], [n, 1]
        scale_row, scale_col = w_scale.reshape(-1).contiguous(), w_scale.t().contiguous()
        w_t = w_fp8.t()
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

            def w8a8() -> torch.Tensor:
                xq, xs = quantize_rows(x)
                return torch._scaled_mm(xq, w_t, scale_a=xs, scale_b=scale_col, out_dtype=torch.bfloat16)

            ref = x.float() @ (w_fp8.float() * w_scale).t()
            err = ((w8a16_mm(x, w_fp8, scale_row).float() - ref).norm() / ref.norm()).item()
            times = [graph_us(lambda: F.linear(x, w), args.iters),
                     graph_us(lambda: w8a16_mm(x, w_fp8, scale_row), args.iters),
                     graph_us(w8a8, args.iters)]
            for i, t in enumerate(times):
                step[m][i] += t * per_step / 1e3
            rates = [n * k * 2 / t / 1e3, n * k / times[1] / 1e3, n * k / times[2] / 1e3]
            bm, bn, bk, split, warps, stages = plan(m, n, k)
            print(f"{name:13s} {n:5d}x{k:<5d} rows {m:4d} | bf16 {times[0]:7.1f} us {rates[0]:5.0f} GB/s"
                  f" | w8a16 {times[1]:7.1f} us {rates[1]:5.0f} GB/s {times[1] / times[0]:5.2f}x"
                  f" (tile {bm}x{bn}x{bk}, split {split}, err {err:.1e})"
                  f" | w8a8 {times[2]:7.1f} us {times[2] / times[0]:5.2f}x", flush=True)
    for m, (bf16, w8a16, w8a8) in step.items():
        print(f"a decode step's matmuls at {m:4d} rows: bf16 {bf16:6.2f} ms, w8a16 {w8a16:6.2f} ms "
              f"({w8a16 / bf16:4.2f}x), w8a8 {w8a8:6.2f} ms ({w8a8 / bf16:4.2f}x)")


if __name__ == "__main__":
    main()
