"""cuBLAS's float8 matmuls at a decode step's rows, by scales and operand order: `python -m bench.kernels.fp8_cublas`.

For each of the Local-v1.5 talker's weight shapes at each row count of `--rows`, this times,
from CUDA graphs, with enough weight copies in turn that no call finds its weights in L2: bf16
`F.linear` (cuBLAS, as served in bf16), then `torch._scaled_mm`'s float8 products with one scale
per row and per output channel ("row") and with one scale per tensor ("tensor", the kind the w8a8
scheme of `stages.runtime.fp8_linear` calls with unit scales), rows first (`x_fp8 @ W_fp8^T`) and
weights first (`(W_fp8 @ x_fp8^T)^T`, the rows in the product's narrow dimension; "+T" when the
transposed output is copied row-major). Each way's distance from the fp32 product is printed
beside its time. The rows are quantized outside the timing (a compiled step fuses that into the
norm before). The last lines add one decode step's matmuls up (36 backbone layers, the local
block 12 times a frame). `--quick` runs one tiny shape on the CPU (torch's own float8 matmul,
host-timed): the code path, not a time.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.kernels.timing import graph_us
from stages.runtime.fp8_linear import quantize_rows

SHAPES = (("qkv", 6144, 2560, 36), ("o", 2560, 4096, 36), ("gate_up", 19456, 2560, 36), ("down", 2560, 9728, 36),
          ("local c_attn", 7680, 2560, 12), ("local c_proj", 2560, 2560, 12), ("local fc_in", 9728, 2560, 12),
          ("local fc_out", 2560, 9728, 12))
QUICK_SHAPES = (("tiny", 64, 256, 1),)
L2_BYTES = 50 * 2**20  # an H200's L2: the copies in turn read at least 4x this
WAYS = ("bf16", "row x-first", "row w-first", "row w-first+T", "tensor x-first", "tensor w-first+T")


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (x_fp8, scale []) with x ≈ x_fp8 * scale: one scale for the whole tensor."""
    x_fp8, scale = quantize_rows(x.reshape(1, -1))  # the whole tensor as one row
    return x_fp8.view(x.shape), scale.reshape(())


def rotating(fn, copies: int):
    """A call that runs `fn(i)` on the next of `copies` operand sets each time."""
    state = [0]

    def call():
        fn(state[0] % copies)
        state[0] += 1
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 48, 64, 96])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="one tiny shape on the CPU")
    args = ap.parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.quick:
        args.rows, args.iters = [16], 1
    elif not torch.cuda.is_available():
        raise SystemExit("bench.kernels.fp8_cublas needs a CUDA device with float8 matmuls (sm89+), or --quick")
    dev = torch.device("cpu" if args.quick else "cuda")
    print(f"torch {torch.__version__}, {dev.type}; us a call (from a graph on CUDA), weights from memory")
    step = {m: [0.0] * len(WAYS) for m in args.rows}
    for name, n, k, per_step in shapes:
        copies = 2 if args.quick else max(2, -(-4 * L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]  # [n, k]
        row_q = [quantize_rows(w) for w in ws]  # ([n, k] fp8, [n, 1])
        ten_q = [quantize_tensor(w) for w in ws]  # ([n, k] fp8, [])
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)  # [m, k]
            xq, xs = quantize_rows(x)  # [m, k], [m, 1]
            xs_t = xs.t().contiguous()  # [1, m]
            xtq, xts = quantize_tensor(x)
            ref = x.float() @ ws[0].float().t()  # [m, n]
            out = torch.bfloat16 if dev.type == "cuda" else torch.float32

            def bf16(i):
                return F.linear(x, ws[i])

            def row_x_first(i):
                w8, s = row_q[i]
                return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=s.t(), out_dtype=out)

            def row_w_first(i):
                w8, s = row_q[i]
                return torch._scaled_mm(w8, xq.t(), scale_a=s, scale_b=xs_t, out_dtype=out).t()  # [m, n] view

            def row_w_first_t(i):
                return row_w_first(i).contiguous()

            def tensor_x_first(i):
                w8, s = ten_q[i]
                return torch._scaled_mm(xtq, w8.t(), scale_a=xts, scale_b=s, out_dtype=out)

            def tensor_w_first_t(i):
                w8, s = ten_q[i]
                return torch._scaled_mm(w8, xtq.t(), scale_a=s, scale_b=xts, out_dtype=out).t().contiguous()

            fns = (bf16, row_x_first, row_w_first, row_w_first_t, tensor_x_first, tensor_w_first_t)
            times, errs = [], []
            for fn in fns:
                try:
                    errs.append((fn(0).float() - ref).norm().item() / ref.norm().item())
                    times.append(graph_us(rotating(fn, copies), args.iters))
                except Exception as e:  # a layout or size cuBLAS refuses: named, not timed
                    print(f"  {name} rows {m} {fn.__name__}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    times.append(float("nan"))
                    errs.append(float("nan"))
            for i, t in enumerate(times):
                step[m][i] += t * per_step / 1e3
            cells = " | ".join(f"{w} {t:6.1f} us {t / times[0]:4.2f}x e{e:.0e}" for w, t, e in zip(WAYS, times, errs))
            print(f"{name:13s} {n:5d}x{k:<5d} rows {m:3d} ({copies} copies, bf16 {n * k * 2 / times[0] / 1e3:4.0f} GB/s)"
                  f" | {cells}", flush=True)
    for m, ms in step.items():
        cells = ", ".join(f"{w} {t:5.2f} ms ({t / ms[0]:4.2f}x)" for w, t in zip(WAYS, ms))
        print(f"a decode step's matmuls at {m:3d} rows: {cells}")


if __name__ == "__main__":
    main()
