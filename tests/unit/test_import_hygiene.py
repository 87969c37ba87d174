"""
Import hygiene: no module of the package or of devkit imports another that imports it back,
directly or through others. (That Dag-file imports, the trigger modules and ``_core``, load no
broker SDK is checked in a fresh interpreter for every registry entry at once:
``tests/unit/test_broker_registry.py`` with ``tests/unit/import_probe.py``.)
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

# -- no import circles -----------------------------------------------------------------------------
REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKED_PACKAGES = ("airflow_shared_stream_provider", "devkit")
# Edges of a circle in files under another change at the time of writing: _core/batching.py imports
# DeliveryLike from _core/producer.py (under TYPE_CHECKING), which imports batching. Listed one by
# one so that no other circle can hide behind them, and checked to still exist so that the entry
# goes once the circle is broken (DeliveryLike one floor down, in a module both import).
KNOWN_CIRCLE_EDGES: set[tuple[str, str]] = set()


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """
    Module -> the modules of ``packages`` it imports, from every import statement in the file:
    top level, inside functions and under ``if TYPE_CHECKING:`` alike (a circle through any of
    them is still a circle: for readers, for type checkers, and at run time once called).
    """
    files = {module_name(root, path): path for package in packages for path in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from package import module`` imports the module; ``from module import name`` the module.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            graph[name].update(target for target in targets if target in files and target != name)
    return graph


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (each is at least one import circle), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def test_no_import_circles_in_the_package_or_devkit() -> None:
    graph = import_graph(REPO_ROOT, CHECKED_PACKAGES)
    assert "airflow_shared_stream_provider.producers.servicebus" in graph and "devkit.demo" in graph
    stale = {edge for edge in KNOWN_CIRCLE_EDGES if edge[1] not in graph.get(edge[0], set())}
    assert not stale, f"these circles are broken now: remove them from KNOWN_CIRCLE_EDGES: {sorted(stale)}"
    for source, target in KNOWN_CIRCLE_EDGES:
        graph[source].discard(target)
    circles = find_circles(graph)
    described = [" <-> ".join(circle) + ": " + "; ".join(_edges(graph, circle)) for circle in circles]
    assert not circles, "import circles (move what both sides need into a module both import):\n" + "\n".join(described)


def _edges(graph: dict[str, set[str]], circle: list[str]) -> list[str]:
    return [f"{source} -> {target}" for source in circle for target in sorted(graph[source] & set(circle))]


def test_circles_through_function_level_and_type_checking_imports_are_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n    return b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"  # relative, type-only
    )
    (package / "c.py").write_text("import pkg.a\nclass C: ...\n")
    (package / "d.py").write_text("from pkg.c import C\n")  # imports into the circle, not part of it
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert find_circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    graph["pkg.c"].clear()
    assert find_circles(graph) == []
