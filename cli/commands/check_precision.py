"""`mossvox check-precision`: whether a profile's precision changes keep a checkpoint's outputs
near bf16 (`stages.models.local_v15.precision_check`).

    mossvox check-precision MODEL_DIR [--profile P --set k=v] [--device cpu|cuda|cuda:N]
                            [--prompts N] [--frames N] [--seed S] [--max-kl X]

It runs the checkpoint fp32, bf16 and as the profile has it (float8 weights, a float8 KV cache)
over the same prompts and sampled codes, prints KL, top-1 and sampled-token agreement, and PASS
or FAIL against the bound (exit status 0 or 1; 2 when it cannot run). Local-v1.5 checkpoints.
For example, before serving float8 weights:

    mossvox check-precision /models/moss-tts-local-v1.5 --profile high-concurrency \\
        --set talker.fp8_weights=backbone --set talker.fp8_scheme=w8a8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="checkpoint directory (Local-v1.5)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: the profile's model.device; auto = cuda when available)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts run at once (default 8)")
    parser.add_argument("--frames", type=int, default=256, help="frames (steps) a prompt (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="the first prompt's sampling seed (default 0)")
    parser.add_argument("--max-kl", type=float, default=None,
                        help="the bound: mean KL against bf16 at the sampling temperature, nats a code "
                             "(default 1e-3)")


def run(args: argparse.Namespace) -> int:
    from profiles.arguments import profile_from_args
    from stages.models.local_v15.precision_check import check_precision, precision_changes
    from stages.models.local_v15.variant import LocalV15Variant
    from stages.registry import load_variant
    from stages.runtime.fidelity import FidelityBound
    from stages.workers.placement import resolve_device

    profile = profile_from_args(args)
    if not (args.model_dir / "config.json").is_file():
        print(f"mossvox: {args.model_dir} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    if args.prompts < 1 or args.frames < 1:
        print("mossvox: --prompts and --frames must be at least 1", file=sys.stderr)
        return 2
    variant = load_variant(args.model_dir, profile)
    if not isinstance(variant, LocalV15Variant):
        print(f"mossvox: check-precision covers MOSS-TTS-Local-Transformer-v1.5 checkpoints (float8 weights are "
              f"theirs), not {variant.description}", file=sys.stderr)
        return 2
    changes = precision_changes(profile)
    if not changes:
        print("the profile changes no precision (bf16 as loaded): nothing to check")
        return 0
    device = resolve_device(args.device or profile.model.device)
    bound = FidelityBound() if args.max_kl is None else FidelityBound(max_kl=args.max_kl)
    try:
        report = check_precision(args.model_dir, profile, device, prompts=args.prompts, frames=args.frames,
                                 seed=args.seed, bound=bound, log=lambda line: print(line, flush=True))
    except ValueError as exc:
        print(f"mossvox: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report.lines()))
    return 0 if report.passed else 1
