"""The float8 layer's own kernels by warps, against the compiled torch ops: `python -m bench.kernels.fp8_kernels`.

At each row count of `--rows`, at the Local-v1.5 backbone's widths (gate|up 2 x 9,728 columns,
the hidden size 2,560), this times from CUDA graphs the kernels a layer runs around its float8
matmuls (`talker.fp8_fused_swiglu`: `stages.runtime.fp8_swiglu`; `talker.fp8_fused_norms`:
`stages.runtime.fp8_norm`), one program a row at each of several warp counts, beside the same
arithmetic compiled by inductor (what a layer runs without them), and prints each way's time and
the share of its float8 codes equal to the torch ops'. Inputs stay in L2 (as a layer's, written
by the kernel before). `--quick` runs tiny widths on the CPU (Triton's interpreter,
TRITON_INTERPRET=1 before triton is imported; the torch ops eagerly): the code path, not a time.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels.timing import graph_us

SWIGLU_WARPS = (4, 8, 16, 32)
NORM_WARPS = (2, 4, 8, 16)


def _codes_equal(got: torch.Tensor, want: torch.Tensor) -> float:
    """The share of float8 codes equal in two quantized tensors."""
    return (got.float() == want.float()).float().mean().item()


def swiglu_line(rows: int, cols: int, iters: int, device: torch.device, compiled: bool) -> str:
    """SiLU(gate) * up quantized per row from gate|up's float8 product [rows, 2 x cols]."""
    from stages.runtime.fp8_linear import FP8
    from stages.runtime.fp8_swiglu import launch_silu_mul_quant, silu_mul_quant_torch

    g = torch.Generator().manual_seed(0)
    raw = (torch.randn(rows, 2 * cols, generator=g) * 3000).to(device, torch.bfloat16)
    x_scale = (torch.rand(rows, 1, generator=g) * 1e-3 + 1e-4).to(device)
    w_scale = (torch.rand(2 * cols, generator=g) * 1e-3 + 1e-4).to(device)
    want, _ = silu_mul_quant_torch(raw, x_scale, w_scale, torch.float32)

    def torch_ops(fn=torch.compile(silu_mul_quant_torch, dynamic=False) if compiled else silu_mul_quant_torch):
        return fn(raw, x_scale, w_scale, torch.bfloat16)

    cells = [f"{'compiled' if compiled else 'torch'} {graph_us(torch_ops, iters):6.2f} us"]
    out = torch.empty(rows, cols, dtype=FP8, device=device)
    out_scale = torch.empty(rows, 1, dtype=torch.float32, device=device)
    for warps in SWIGLU_WARPS:
        def kernel(warps=warps):
            launch_silu_mul_quant(raw, x_scale, w_scale, out, out_scale, num_warps=warps)

        us = graph_us(kernel, iters)
        cells.append(f"{warps} warps {us:6.2f} us ({100 * _codes_equal(out, want):.1f}% codes)")
    return f"swiglu rows {rows:3d} x {cols}: " + " | ".join(cells)


def norm_line(rows: int, cols: int, iters: int, device: torch.device, compiled: bool) -> str:
    """x + a float8 product with its scales, RMSNorm, quantized per row [rows, cols]."""
    from stages.runtime.fp8_linear import FP8
    from stages.runtime.fp8_norm import add_rms_norm_quant_torch, launch_add_rms_norm_quant

    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, cols, generator=g).to(device, torch.bfloat16)
    raw = (torch.randn(rows, cols, generator=g) * 3000).to(device, torch.bfloat16)
    row_scale = (torch.rand(rows, 1, generator=g) * 1e-3 + 1e-4).to(device)
    col_scale = (torch.rand(cols, generator=g) * 1e-3 + 1e-4).to(device)
    weight = (1 + 0.1 * torch.randn(cols, generator=g)).to(device, torch.bfloat16)
    args = (x, raw, row_scale, col_scale, weight, 1e-6)
    _, want, _ = add_rms_norm_quant_torch(*args)

    def torch_ops(fn=torch.compile(add_rms_norm_quant_torch, dynamic=False) if compiled else add_rms_norm_quant_torch):
        return fn(*args)

    cells = [f"{'compiled' if compiled else 'torch'} {graph_us(torch_ops, iters):6.2f} us"]
    out_sum = torch.empty_like(x)
    out = torch.empty(rows, cols, dtype=FP8, device=device)
    out_scale = torch.empty(rows, 1, dtype=torch.float32, device=device)
    for warps in NORM_WARPS:
        def kernel(warps=warps):
            launch_add_rms_norm_quant(*args, out_sum, out, out_scale, num_warps=warps)

        us = graph_us(kernel, iters)
        cells.append(f"{warps} warps {us:6.2f} us ({100 * _codes_equal(out, want):.1f}% codes)")
    return f"norm rows {rows:3d} x {cols}: " + " | ".join(cells)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 48, 96])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="tiny widths on the CPU (Triton's interpreter)")
    args = ap.parse_args(argv)
    if args.quick:
        device, rows, iters, swiglu_cols, norm_cols = torch.device("cpu"), [3], 1, 48, 64
    elif torch.cuda.is_available():
        device, rows, iters, swiglu_cols, norm_cols = torch.device("cuda"), args.rows, args.iters, 9728, 2560
    else:
        raise SystemExit("bench.kernels.fp8_kernels needs a CUDA device, or --quick")
    compiled = device.type == "cuda"
    print(f"torch {torch.__version__}, {device.type}; us a call (from a graph on CUDA)", flush=True)
    for m in rows:
        print(swiglu_line(m, swiglu_cols, iters, device, compiled), flush=True)
        print(norm_line(m, norm_cols, iters, device, compiled), flush=True)


if __name__ == "__main__":
    main()
