"""`--concurrency` in both bench commands: one level, a comma list or the option repeated sweep
every level given, in order; the default is in the help; a bad level is a usage error."""

import argparse
import json

import pytest

from bench.levels import levels_of
from cli.commands import bench_engine, bench_serve
from cli.main import main

COMMANDS = {"serve": (bench_serve, [1]), "engine": (bench_engine, [1, 4, 16])}


def parser_of(command) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench")
    command.add_arguments(parser)
    return parser


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_repeated_and_comma_levels_all_run_and_the_default_is_shown(name):
    command, default = COMMANDS[name]
    parser = parser_of(command)
    assert levels_of(parser.parse_args(["--concurrency", "1", "--concurrency", "4,16"])) == [1, 4, 16]
    assert levels_of(parser.parse_args(["--concurrency", "8,2"])) == [8, 2]
    assert levels_of(parser.parse_args([])) == default
    assert f"(default: {','.join(map(str, default))})" in " ".join(parser.format_help().split())
    for bad in ("0", "two", "4,-1", ","):
        with pytest.raises(SystemExit):
            parser.parse_args(["--concurrency", bad])


def test_bench_engine_runs_each_repeated_level(tmp_path, capsys):
    """The reported case: `--concurrency 1 --concurrency 2` ran only the last level."""
    out = tmp_path / "engine.json"
    assert main(["bench", "engine", "--concurrency", "1", "--concurrency", "2", "--frames", "2",
                 "--requests-per-client", "1", "--baseline-requests", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows if r["name"].startswith("engine")] == [1, 2]
