"""Resolve a profile: the `base:` chain, `--set` overrides, strict decoding, named errors.

Precedence, lowest first: schema defaults < the root of the `base:` chain < ... < the named file
< each `key.path=value` override in order. Mappings merge recursively; scalars and lists replace.
Every merged leaf remembers which file (or override) set it last, so an error can name it.
"""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any, Iterable

import msgspec
import yaml

from profiles.schema import CrossFieldError, Profile, ProfileError

PROFILE_DIR = Path(__file__).parent
SCHEMA_DEFAULT = "schema default"

KeyPath = tuple[str, ...]


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-3` as a float (YAML 1.1 wants `1.0e-3`) and refuses a key
    repeated in one mapping (PyYAML would silently keep the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped in this package."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def profile_summary(name: str) -> str:
    """What a shipped profile is for: its file's first line, ``# name: summary``."""
    first = (PROFILE_DIR / f"{name}.yaml").read_text(encoding="utf-8").partition("\n")[0]
    return first.lstrip("#").strip().removeprefix(f"{name}:").strip()


def load_profile(name_or_path: str = "default", overrides: Iterable[str] = ()) -> Profile:
    """Load a shipped profile by name, or a YAML file by path, plus `key.path=value` overrides.

    Raises ProfileError naming the key path and the file(s) (or override) it came from.
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key.path=value' strings, not one string")
    merged: dict[str, Any] = {}
    provenance: dict[KeyPath, str] = {}
    for source, tree in _read_chain(name_or_path):
        _merge(merged, tree, source, provenance, ())
    for text in overrides:
        path, value = parse_override(text)
        _merge(merged, _nest(path, value), f"--set {text}", provenance, ())
    return _decode(merged, provenance)


def parse_override(text: str) -> tuple[KeyPath, Any]:
    """Split `key.path=value`; the value is parsed as a YAML scalar or flow value."""
    key, sep, raw = text.partition("=")
    parts = tuple(part.strip() for part in key.split("."))
    if not sep or not all(parts):
        raise ProfileError(f"malformed override {text!r}: expected key.path=value",
                           key_path=key.strip(), sources=(f"--set {text}",))
    try:
        value = yaml.load(raw, Loader=_YamlLoader)
    except yaml.YAMLError as exc:
        raise ProfileError(f"malformed override {text!r}: value is not YAML ({exc})",
                           key_path=".".join(parts), sources=(f"--set {text}",)) from None
    _check_key_path(parts, f"--set {text}")
    return parts, value


def _read_chain(name_or_path: str) -> list[tuple[str, dict]]:
    """Files of the `base:` chain, root first, each with its tree minus `base`."""
    chain: list[tuple[str, dict]] = []
    seen: list[str] = []
    ref, relative_to = name_or_path, Path.cwd()
    while ref is not None:
        path = _locate(ref, relative_to, referrer=seen[-1] if seen else None)
        source = str(path)
        if source in seen:
            cycle = " -> ".join([*seen[seen.index(source):], source])
            raise ProfileError(f"cycle in base: {cycle}", key_path="base", sources=tuple(seen))
        seen.append(source)
        tree = _read_yaml(path)
        ref = tree.pop("base", None)
        if ref is not None and not isinstance(ref, str):
            raise ProfileError(f"base: expected a profile name or path, got {ref!r} "
                               f"(from {source})", key_path="base", sources=(source,))
        chain.append((source, tree))
        relative_to = path.parent
    return chain[::-1]


def _locate(ref: str, relative_to: Path, referrer: str | None) -> Path:
    """A shipped profile name, or a path (contains '/' or ends in .yaml/.yml)."""
    where = f" (base of {referrer})" if referrer else ""
    if "/" in ref or ref.endswith((".yaml", ".yml")):
        path = (relative_to / Path(ref).expanduser()).resolve()
        if not path.is_file():
            raise ProfileError(f"profile file not found: {path}{where}", key_path="base",
                               sources=(referrer,) if referrer else ())
        return path
    path = PROFILE_DIR / f"{ref}.yaml"
    if not path.is_file():
        raise ProfileError(
            f"unknown profile {ref!r}{where}; shipped: {', '.join(shipped_profiles())} "
            "(a path must contain '/' or end in .yaml)", key_path="base",
            sources=(referrer,) if referrer else ())
    return path.resolve()


def _read_yaml(path: Path) -> dict:
    try:
        tree = yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader)
    except (OSError, yaml.YAMLError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}", sources=(str(path),)) from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ProfileError(f"profile {path} must be a mapping, got {type(tree).__name__}",
                           sources=(str(path),))
    return tree


def _nest(path: KeyPath, value: Any) -> dict:
    for key in reversed(path):
        value = {key: value}
    return value


def _merge(dst: dict, src: dict, source: str, prov: dict[KeyPath, str], prefix: KeyPath) -> None:
    """Merge `src` into `dst` in place: mappings recursively, anything else replaces."""
    for key, value in src.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, source, prov, path)
            continue
        for stale in [p for p in prov if p[:len(path)] == path]:
            del prov[stale]
        dst[key] = copy.deepcopy(value)
        _record(value, source, prov, path)


def _record(value: Any, source: str, prov: dict[KeyPath, str], path: KeyPath) -> None:
    prov[path] = source
    if isinstance(value, dict):
        for key, child in value.items():
            _record(child, source, prov, (*path, str(key)))


def _sources(key_path: str, prov: dict[KeyPath, str]) -> str:
    """Who set `key_path` last (or its nearest set ancestor); else the schema default."""
    parts = tuple(re.sub(r"\[\d+\]", "", key_path).split(".")) if key_path else ()
    for n in range(len(parts), 0, -1):
        if parts[:n] in prov:
            return prov[parts[:n]]
    return SCHEMA_DEFAULT


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<where>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`$")


def _decode(tree: dict, prov: dict[KeyPath, str]) -> Profile:
    try:
        return msgspec.convert(tree, Profile)
    except CrossFieldError as exc:
        named = "; ".join(f"{p} from {_sources(p, prov)}" for p in exc.paths)
        raise ProfileError(f"{exc} ({named})", key_path=exc.paths[0],
                           sources=tuple(dict.fromkeys(_sources(p, prov) for p in exc.paths))
                           ) from None
    except msgspec.ValidationError as exc:
        match = _AT.match(str(exc))
        what, where = match["what"], (match["where"] or "").lstrip(".")
        unknown = _UNKNOWN.match(what)
        if unknown:
            where = f"{where}.{unknown['field']}" if where else unknown["field"]
            what = "unknown key" + _suggest(where)
        source = _sources(where, prov)
        raise ProfileError(f"{where or '<profile>'}: {what} (from {source})", key_path=where,
                           sources=(source,)) from None


def _check_key_path(parts: KeyPath, source: str) -> None:
    """Raise unless `parts` names a section or field of Profile."""
    struct: Any = Profile
    for i, part in enumerate(parts):
        if not (isinstance(struct, type) and issubclass(struct, msgspec.Struct)):
            raise ProfileError(f"{'.'.join(parts)}: {'.'.join(parts[:i])} is a value, not a "
                               f"section (from {source})", key_path=".".join(parts),
                               sources=(source,))
        fields = {f.name: f.type for f in msgspec.structs.fields(struct)}
        if part not in fields:
            key_path = ".".join(parts)
            raise ProfileError(f"{key_path}: unknown key{_suggest(key_path)} (from {source})",
                               key_path=key_path, sources=(source,))
        struct = fields[part]


def _all_key_paths() -> list[str]:
    out = []
    for section in msgspec.structs.fields(Profile):
        out += [f"{section.name}.{f.name}" for f in msgspec.structs.fields(section.type)]
    return out


def _suggest(key_path: str) -> str:
    close = difflib.get_close_matches(key_path, _all_key_paths(), n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""
