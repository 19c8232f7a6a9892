"""`--profile NAME|PATH` and repeated `--set key.path=value`: the options of every command that
takes a profile, and the resolved `Profile` they name (base < file < `--set`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from profiles import Profile


def add_profile_options(parser: argparse.ArgumentParser) -> None:
    """`--profile NAME|PATH` and repeated `--set key.path=value`."""
    parser.add_argument("--profile", default=None, metavar="NAME|PATH",
                        help="deploy profile: a shipped name (default, low-latency, "
                             "high-concurrency, cpu) or a YAML path")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY.PATH=VALUE",
                        help="override one profile value (YAML syntax); repeatable, "
                             "later wins, beats the profile files")


def profile_from_args(args: argparse.Namespace, default: str = "default") -> Profile:
    """The profile named by `--profile` (or `default`) with the `--set` overrides applied."""
    from profiles import load_profile

    return load_profile(args.profile or default, args.overrides)
