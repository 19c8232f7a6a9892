"""`mossvox make-checkpoint`: write a random-weight checkpoint directory of a variant.

    mossvox make-checkpoint --variant local-v1.5|delay|ttsd|sound-effect|voice-generator|realtime
                            --size tiny|full --out DIR [--seed N]
                            [--dtype float32|bfloat16] [--max-shard-gb G] [--outlier-channels]

The weights are seeded random numbers (no real checkpoint is used): the model loads and
runs at the real size and speed, but its audio is noise-like and its stop head fires at random.
`--outlier-channels` gives the talker's backbone the activation outliers of released LLMs (a few
channels 20-100x the rest, massive activations at the chat delimiters;
`stages.tools.outlier_channels`), for `mossvox check-precision`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "fp32": "float32", "bf16": "bfloat16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stages.tools.make_checkpoint import checkpoint_recipes

    parser.add_argument("--variant", default="local-v1.5", choices=list(checkpoint_recipes()),
                        help="model variant (talker + its codec)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "full"],
                        help="tiny (CPU tests) or full (the real shapes, for GPU benchmarks)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (must be empty or absent)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (per-tensor generators)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="stored dtype; default float32 for tiny, bfloat16 for full")
    parser.add_argument("--max-shard-gb", type=float, default=None,
                        help="largest safetensors shard in GiB (default 2)")
    parser.add_argument("--outlier-channels", action="store_true",
                        help="the backbone's weights give its activations released LLMs' outlier channels "
                             "(4 channels 20-100x the rest, massive activations at the chat delimiters)")


def run(args: argparse.Namespace) -> int:
    import torch

    from stages.tools.make_checkpoint import make_checkpoint
    from stages.tools.outlier_channels import OutlierChannels

    out: Path = args.out
    if out.exists() and any(out.iterdir()):
        print(f"mossvox: {out} exists and is not empty", file=sys.stderr)
        return 2
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    shard = int(args.max_shard_gb * (1 << 30)) if args.max_shard_gb else None
    start = time.perf_counter()
    def progress(path: Path) -> None:
        print(f"  {path} ({path.stat().st_size / 1e9:.3f} GB, {time.perf_counter() - start:.1f} s)", flush=True)

    summary = make_checkpoint(out, variant=args.variant, size=args.size, seed=args.seed,
                              dtype=dtype, max_shard_bytes=shard, on_file=progress,
                              outliers=OutlierChannels() if args.outlier_channels else None)
    took = time.perf_counter() - start
    for label, w in (("talker", summary.talker), ("codec", summary.codec)):
        print(f"{label}: {w.num_params:,} parameters, {w.total_bytes / 1e9:.3f} GB in {len(w.files)} file(s)")
    outliers = ", outlier channels" if args.outlier_channels else ""
    print(f"wrote {out} in {took:.1f} s (random weights{outliers}: noise-like audio, no stop decision)")
    return 0
