"""The `mossvox` console script: a table of subcommands, each imported only when it runs.

`mossvox --help` imports nothing but argparse and this file (no torch). A command whose module
does not exist yet is listed with "(not available yet)" and exits 2 saying so. To add a command,
add one line to COMMANDS and write its module (see `cli/commands/__init__.py` for the module
contract).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union


@dataclass(frozen=True)
class Command:
    """A subcommand whose module provides `add_arguments(parser)` and `run(args) -> int`."""

    name: str
    help: str
    module: str
    takes_profile: bool = True  # add --profile / --set for it


@dataclass(frozen=True)
class Passthrough:
    """A subcommand handed the rest of argv: calls `module.main(argv) -> int` (own parser)."""

    name: str
    help: str
    module: str


@dataclass(frozen=True)
class Group:
    """A subcommand with its own subcommands (e.g. `mossvox bench ipc`)."""

    name: str
    help: str
    children: tuple[Entry, ...]


Entry = Union[Command, Passthrough, Group]

COMMANDS: tuple[Entry, ...] = (
    Command("serve", "run the OpenAI-compatible /v1/audio/speech server",
            "cli.commands.serve"),
    Command("synth", "synthesise text to an audio file without a server",
            "cli.commands.synth"),
    Group("bench", "benchmarks (not timed tests)", (
        Passthrough("ipc", "ring throughput and wake-up latency vs multiprocessing Queue/Pipe",
                    "bench.ipc"),
        Command("engine", "offline engine throughput and first-chunk time (no HTTP)",
                "cli.commands.bench_engine"),
        Command("serve", "closed-loop streaming clients against a running server",
                "cli.commands.bench_serve", takes_profile=False),
    )),
    Command("check-precision", "whether a profile's precision changes (float8) keep a checkpoint's outputs near bf16",
            "cli.commands.check_precision"),
    Command("make-checkpoint", "write a random-weight checkpoint directory of a variant",
            "cli.commands.make_checkpoint", takes_profile=False),
    Command("profile", "deploy profiles: show the resolved one, list the shipped ones, list the settings",
            "cli.commands.profile", takes_profile=False),
)


def main(argv: Sequence[str] | None = None, commands: tuple[Entry, ...] = COMMANDS) -> int:
    """Run `mossvox ARGV`; returns the exit status (2 for usage and profile errors). When the
    reader of the output goes away (`mossvox profile fields | head`), it stops quietly."""
    try:
        status = _main(argv, commands)
        sys.stdout.flush()  # inside the try: a pipe closed early fails here, not at exit
        return status
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141  # 128 + SIGPIPE, what a shell reports for a tool stopped by a closed pipe


def _main(argv: Sequence[str] | None, commands: tuple[Entry, ...]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    path, rest = _selected(argv, commands)
    leaf = path[-1] if path else None
    wants_help = any(a in ("-h", "--help") for a in rest)
    if isinstance(leaf, (Command, Passthrough)) and not _available(leaf) and not wants_help:
        return _not_available(path)
    if isinstance(leaf, Passthrough) and argv[:len(path)] == [e.name for e in path]:
        return int(importlib.import_module(leaf.module).main(rest) or 0)
    parser = _build_parser(commands, leaf)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return _run(args._entry, args)


def _run(entry: Command, args: argparse.Namespace) -> int:
    from profiles import ProfileError

    try:
        return int(importlib.import_module(entry.module).run(args) or 0)
    except ProfileError as exc:
        print(f"mossvox: profile error: {exc}", file=sys.stderr)
        return 2


def _selected(argv: list[str], entries: tuple[Entry, ...]) -> tuple[list[Entry], list[str]]:
    """The chain of entries the leading command words name, and the argv after them."""
    path: list[Entry] = []
    for i, word in enumerate(argv):
        if word.startswith("-"):
            return path, argv[i:]
        found = next((e for e in entries if e.name == word), None)
        if found is None:
            return path, argv[i:]
        path.append(found)
        if not isinstance(found, Group):
            return path, argv[i + 1:]
        entries = found.children
    return path, []


def _available(entry: Command | Passthrough) -> bool:
    """Whether the entry's module exists, found on disk without importing any package
    (`find_spec("bench.ipc")` would import `ipc` and, through it, numpy)."""
    top, *rest = entry.module.split(".")
    spec = importlib.util.find_spec(top)  # a top-level lookup imports nothing
    if spec is None or not rest:
        return spec is not None
    dirs = [Path(d) for d in spec.submodule_search_locations or ()]
    for part in rest[:-1]:
        dirs = [d / part for d in dirs if (d / part / "__init__.py").is_file()]
    name = rest[-1]
    return any((d / f"{name}.py").is_file() or (d / name / "__init__.py").is_file() for d in dirs)


def _not_available(path: list[Entry]) -> int:
    name = " ".join(e.name for e in path)
    print(f"mossvox: '{name}' is not available yet", file=sys.stderr)
    return 2


def _build_parser(commands: tuple[Entry, ...], selected: Entry | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mossvox", description="mossvox: a streaming serving engine for MOSS-TTS models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _add_entries(parser, commands, selected)
    return parser


def _add_entries(parser: argparse.ArgumentParser, entries: tuple[Entry, ...],
                 selected: Entry | None) -> None:
    sub = parser.add_subparsers(metavar="COMMAND", required=True)
    for entry in entries:
        help_text = entry.help
        if not isinstance(entry, Group) and not _available(entry):
            help_text += " (not available yet)"
        child = sub.add_parser(entry.name, help=help_text, description=help_text)
        if isinstance(entry, Group):
            _add_entries(child, entry.children, selected)
        elif entry is selected and isinstance(entry, Command) and _available(entry):
            _add_command_arguments(child, entry)
        child.set_defaults(_entry=entry)


def _add_command_arguments(parser: argparse.ArgumentParser, entry: Command) -> None:
    module = importlib.import_module(entry.module)
    if entry.takes_profile:
        from profiles.arguments import add_profile_options

        add_profile_options(parser)
    module.add_arguments(parser)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mossvox")
    except PackageNotFoundError:
        return "unknown"
