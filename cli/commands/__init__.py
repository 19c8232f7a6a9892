"""The `mossvox` subcommands, one module each, imported only when that command runs.

A command module (registered in `cli/main.py`'s COMMANDS table) provides:

    def add_arguments(parser: argparse.ArgumentParser) -> None   # its options
    def run(args: argparse.Namespace) -> int                     # exit status

Commands registered with `takes_profile=True` get `--profile` and `--set` added for them
(`profiles.arguments`); `profiles.arguments.profile_from_args(args)` turns those into the resolved
`Profile`. A ProfileError raised from `run` is reported as a one-line error with exit status 2.
"""
