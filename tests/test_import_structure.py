"""The import structure of the whole project: no import cycle anywhere, and layers import only
downward.

The graph is read from the source (every `import` statement of every module, also those inside
functions, which run later but still tie the modules together), not from what happens to be
imported at run time. Layers, lowest first:

    profiles, speech  <-  ipc  <-  stages  <-  engine  <-  api  <-  bench  <-  cli

Inside `stages/`, the shared machinery (`stages/runtime/`) imports nothing else of `stages/`, and
the developer tools (`stages/tools/`) are imported by nothing else of `stages/`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = (("profiles", "speech"), ("ipc",), ("stages",), ("engine",), ("api",), ("bench",), ("cli",))
RANK = {package: rank for rank, tier in enumerate(LAYERS) for package in tier}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in RANK for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports (a name imported from a package counts as its module
    when it is one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, set(mods)) - {name} for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def in_part(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a package into one of the same layer or a higher one."""
    def rank(module: str) -> int:
        return RANK[module.split(".")[0]]

    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if a.split(".")[0] != b.split(".")[0] and rank(b) >= rank(a))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_is_read(graph) -> None:
    # the reader sees the seams this test guards (a reader that found nothing would pass anything)
    assert "stages.variant" in graph["stages.registry"]
    assert "stages.workers.talker" in graph["engine.worker_procs"]
    assert "speech.sampling" in graph["ipc.messages"]
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300


def test_no_import_cycle(graph) -> None:
    assert cycles(graph) == []


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_layers_import_only_downward(graph) -> None:
    assert upward_imports(graph) == []


def test_upward_imports_are_found() -> None:
    graph = {"engine.bench": {"api.commands", "stages.registry"}, "ipc.messages": {"speech.sampling"},
             "speech.job": {"profiles"}}
    assert upward_imports(graph) == ["engine.bench -> api.commands", "speech.job -> profiles"]


def test_runtime_imports_nothing_else_of_stages(graph) -> None:
    outward = sorted(f"{a} -> {b}" for a, targets in graph.items() if in_part(a, "stages.runtime")
                     for b in targets if in_part(b, "stages") and not in_part(b, "stages.runtime"))
    assert outward == []


def test_nothing_else_of_stages_imports_the_tools(graph) -> None:
    inward = sorted(f"{a} -> {b}" for a, targets in graph.items()
                    if in_part(a, "stages") and not in_part(a, "stages.tools")
                    for b in targets if in_part(b, "stages.tools"))
    assert inward == []
