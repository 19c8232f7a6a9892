"""`mossvox bench engine`: the offline engine benchmark (`engine.bench`), no HTTP."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.bench import add_arguments as add

    add(parser)


def run(args: argparse.Namespace) -> int:
    from engine.bench import run as run_bench

    return run_bench(args)
