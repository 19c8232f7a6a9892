"""The `--concurrency` option of both bench commands: one level, a comma list, or the option
repeated (`--concurrency 1 --concurrency 4,16` sweeps 1, 4 and 16), with the default in its help."""

from __future__ import annotations

import argparse


def concurrency_levels(text: str) -> list[int]:
    """One `--concurrency` value: a level or a comma list of levels, each >= 1."""
    try:
        levels = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected whole numbers like 1,4,16") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every level must be 1 or more")
    return levels


def add_concurrency_option(parser: argparse.ArgumentParser, default: list[int], what: str) -> None:
    """`--concurrency` into `args.concurrency` (a list of levels, `default` when not given)."""
    parser.add_argument("--concurrency", type=concurrency_levels, action="extend", default=None,
                        metavar="C[,C...]",
                        help=f"{what} at each level; a comma list or the option repeated sweeps "
                             f"them in order (default: {','.join(map(str, default))})")
    parser.set_defaults(concurrency_default=list(default))


def levels_of(args: argparse.Namespace) -> list[int]:
    """The levels asked for, else the option's default."""
    return list(args.concurrency or args.concurrency_default)
