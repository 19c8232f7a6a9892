"""`mossvox profile show|list`: inspect deploy profiles without starting anything."""

from __future__ import annotations

import argparse

from api.commands import add_profile_options, profile_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print the resolved profile as YAML and its SHA-256",
                              description="Print the resolved profile (base chain and --set "
                                          "overrides applied) as YAML, headed by its SHA-256. "
                                          "The output is itself a loadable profile.")
    add_profile_options(show)
    actions.add_parser("list", help="list the shipped profiles")


def run(args: argparse.Namespace) -> int:
    from profiles import shipped_profiles

    if args.action == "list":
        print("\n".join(shipped_profiles()))
        return 0
    profile = profile_from_args(args)
    print(f"# profile: {args.profile or 'default'}")
    for override in args.overrides:
        print(f"# --set {override}")
    print(f"# sha256: {profile.sha256()}")
    print(profile.to_yaml(), end="")
    return 0
