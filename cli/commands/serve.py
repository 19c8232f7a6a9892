"""`mossvox serve [MODEL_DIR]`: the OpenAI-compatible /v1/audio/speech server.

With no MODEL_DIR (and no `model.path` in the profile) it serves the embedded tiny demo model,
whose weights are random, under the `cpu` profile.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                        help="checkpoint directory; omitted = the embedded tiny random-weight demo model")
    parser.add_argument("--host", default=None, help="bind address (profile api.host)")
    parser.add_argument("--port", type=int, default=None, help="TCP port, 0 = any free (profile api.port)")
    parser.add_argument("--api-servers", type=int, default=None, metavar="N",
                        help="API processes sharing the port (profile api.api_servers)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; adds to api.keys)")


def run(args: argparse.Namespace) -> int:
    import msgspec

    from api.server import serve
    from profiles.arguments import profile_from_args

    default = "default" if args.model_dir else "cpu"
    profile = profile_from_args(args, default=default)
    problem = checkpoint_problem(args.model_dir or profile.model.path, profile)
    if problem:
        print(f"mossvox: {problem}", file=sys.stderr)
        return 2
    api = profile.api
    changes = {}
    if args.host is not None:
        changes["host"] = args.host
    if args.port is not None:
        changes["port"] = args.port
    if args.api_servers is not None:
        changes["api_servers"] = args.api_servers
    if args.api_key:
        changes["keys"] = tuple(api.keys) + tuple(args.api_key)
    if changes:
        profile = msgspec.structs.replace(profile, api=msgspec.structs.replace(api, **changes))
    return serve(profile, args.model_dir)


def checkpoint_problem(model_dir: str | None, profile) -> str | None:
    """Why ``model_dir`` cannot be served, said before anything starts (None: it can, or no
    directory was named and the demo model is served)."""
    if not model_dir:
        return None
    from pathlib import Path

    from stages.registry import load_variant

    path = Path(model_dir).expanduser()
    if not path.is_dir():
        return f"{path}: no such checkpoint directory"
    try:
        load_variant(path, profile)  # config.json and the family: cheap, no weights
    except (ValueError, OSError) as exc:
        return str(exc)
    return None
