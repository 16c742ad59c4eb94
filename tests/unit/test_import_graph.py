"""The layout of ``ingest``: its import graph has no circles, and ``ingest.config`` imports no runtime.

The graph is read from the source with :mod:`ast`, nothing is imported. Every ``import`` and
``from ... import`` of an ``ingest`` module counts wherever it stands -- at module level, inside a
function, under ``if TYPE_CHECKING:`` -- because a circle a function-level import hides is still a
circle a reader has to untangle. An import names the deepest module it reaches:
``from ingest.config import kinds`` is an edge to ``ingest.config.kinds`` (a module),
``from ingest.config import PipelineSettings`` one to ``ingest.config`` (the package).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ingest"

#: What ``ingest.config`` may import of ingest: itself, the error types, the pure core, and
#: ``ingest.redact`` -- a leaf (it imports no ingest module) that ``load_settings`` hands every
#: loaded secret to for masking.
CONFIG_MAY_IMPORT = ("ingest.config", "ingest.errors", "ingest.core", "ingest.redact",
                     # pure: the table template, names and type map of pipelines that route to many tables
                     "ingest.mirror")


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` file under ``package`` (``__init__`` is the package)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_names(name: str, path: Path) -> Iterator[str]:
    """The dotted names every import statement of module ``name`` (anywhere in ``path``) reaches:
    ``import a.b`` gives ``a.b``; ``from a import b, c`` gives ``a.b`` and ``a.c`` (each a module, or an
    attribute of module ``a``); relative imports are resolved against ``name``'s package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield from (f"{source}.{alias.name}" for alias in node.names)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module → the modules of the package it imports (itself excluded): each imported name is
    mapped to the longest module name it starts with."""
    known = modules(package)

    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = {module_of(n) for n in imported_names(name, path)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted, in a stable order."""
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
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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
    return sorted(found)


def test_the_package_has_no_import_circle() -> None:
    found = circles(import_graph(PACKAGE))
    assert not found, "import circles (each: modules that import each other, directly or not):\n" + "\n".join(
        f"  {' <-> '.join(c)}" for c in found)


def test_config_imports_nothing_of_the_runtime() -> None:
    """Everything reads the configuration; it reads nothing but itself, pydantic and pure leaves. Sink
    settings classes and formats are found through ingest.config.kinds, by path."""
    graph = import_graph(PACKAGE)
    outside = {f"{m} imports {t}" for m, ts in graph.items() if m == "ingest.config" or m.startswith("ingest.config.")
               for t in ts if not any(t == ok or t.startswith(ok + ".") for ok in CONFIG_MAY_IMPORT)}
    assert not outside, "ingest.config reaches outside " + ", ".join(CONFIG_MAY_IMPORT) + ":\n  " + "\n  ".join(
        sorted(outside))


def test_the_leaves_config_may_import_stay_leaves() -> None:
    """``ingest.errors`` and ``ingest.redact`` import no ingest module, so allowing them brings nothing else in."""
    graph = import_graph(PACKAGE)
    assert graph["ingest.errors"] == set() and graph["ingest.redact"] == set()


@pytest.mark.parametrize(("sources", "expected"), [
    ({"a": "from pkg import b\n", "b": "def f():\n    from pkg.a import x\n"}, [["pkg.a", "pkg.b"]]),
    ({"a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.b\n", "b": "from . import a\n"},
     [["pkg.a", "pkg.b"]]),
    ({"a": "from pkg import b\n", "b": "from pkg import c\n", "c": "import os\n"}, []),
])
def test_the_scan_finds_circles_at_any_depth(tmp_path: Path, sources: dict[str, str],
                                              expected: list[list[str]]) -> None:
    """Function-level, TYPE_CHECKING and relative imports all count; a chain without a loop is no circle."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in sources.items():
        (package / f"{name}.py").write_text(text)
    assert circles(import_graph(package)) == expected
