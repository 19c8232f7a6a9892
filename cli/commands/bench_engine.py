"""`mossvox bench engine`: the offline engine benchmark (`bench.engine`), no HTTP."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.engine import add_arguments as add

    add(parser)


def run(args: argparse.Namespace) -> int:
    from bench.engine import run as run_bench

    return run_bench(args)
