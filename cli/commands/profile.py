"""`mossvox profile show|list|fields`: inspect deploy profiles without starting anything."""

from __future__ import annotations

import argparse

from profiles.arguments import add_profile_options, profile_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print the resolved profile as YAML and its SHA-256",
                              description="Print the resolved profile (base chain and --set "
                                          "overrides applied) as YAML, headed by its SHA-256. "
                                          "The output is itself a loadable profile.")
    add_profile_options(show)
    actions.add_parser("list", help="list the shipped profiles and what each is for")
    actions.add_parser("fields", help="every setting: key path, default, what it does and the "
                                      "shipped profiles that change it")


def run(args: argparse.Namespace) -> int:
    from profiles import profile_summary, shipped_profiles
    from profiles.schema import REDACTED, SECRET_FIELDS

    if args.action == "list":
        names = shipped_profiles()
        width = max(map(len, names))
        print("\n".join(f"{name:<{width}}  {profile_summary(name)}" for name in names))
        return 0
    if args.action == "fields":
        print(_fields_reference())
        return 0
    profile = profile_from_args(args)
    print(f"# profile: {args.profile or 'default'}")
    for override in args.overrides:
        secret = override.split("=", 1)[0].strip() in SECRET_FIELDS
        print(f"# --set {override.split('=', 1)[0]}={REDACTED}" if secret else f"# --set {override}")
    print(f"# sha256: {profile.sha256()}")
    print(profile.redacted().to_yaml(), end="")  # secrets never reach a terminal or a log
    return 0


def _fields_reference() -> str:
    """Every setting: `key = default`, its description, and the shipped profiles that set it
    otherwise (from the schema's own descriptions and the profile files)."""
    import msgspec

    from profiles import Profile

    defs = msgspec.json.schema(Profile)["$defs"]
    shipped = _shipped_values()
    lines = []
    for section, ref in defs["Profile"]["properties"].items():
        for name, spec in defs[ref["$ref"].rsplit("/", 1)[1]]["properties"].items():
            default = msgspec.json.encode(spec.get("default")).decode()
            lines.append(f"{section}.{name} = {default}\n    {spec.get('description', '')}")
            if f"{section}.{name}" in shipped:
                lines.append("    in " + ", ".join(f"{profile}: {value}" for profile, value
                                                  in shipped[f"{section}.{name}"].items()))
    return "\n".join(lines)


def _shipped_values() -> dict[str, dict[str, str]]:
    """key path -> {shipped profile: its value as JSON} wherever that profile differs from the
    schema default."""
    import msgspec

    from profiles import load_profile, shipped_profiles

    default = load_profile("default").to_dict()
    values: dict[str, dict[str, str]] = {}
    for profile in shipped_profiles():
        for section, fields in load_profile(profile).to_dict().items():
            for name, value in fields.items():
                if value != default[section][name]:
                    values.setdefault(f"{section}.{name}", {})[profile] = msgspec.json.encode(value).decode()
    return values
