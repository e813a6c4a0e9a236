"""The import layering holds (docs/architecture.md, the layering): the import-linter contracts of pyproject.toml,
and no import cycle among the subpackages and modules of any package of data_plane, control_plane or
shared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint_imports)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def sibling_cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """Strongly connected groups (more than one member) among the children of `package`, each child
    counted with everything under it: two siblings that import each other, directly or round a loop."""
    children = sorted(graph.find_children(package))
    edges = {
        a: {b for b in children if b != a and graph.direct_import_exists(importer=a, imported=b, as_packages=True)}
        for a in children
    }
    # Tarjan's strongly connected components (the graph has a dozen nodes: recursion is fine)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for child in children:
        if child not in index:
            visit(child)
    return groups


def test_sibling_cycles_finds_a_loop() -> None:
    """The check itself: a loop round three modules is found, a chain is not."""
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    assert sibling_cycles(graph, "pkg") == []
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert sibling_cycles(graph, "pkg") == [["pkg.a", "pkg.b", "pkg.c"]]


@pytest.mark.parametrize(("root", "nested"), [
    ("data_plane", "data_plane.engine"),
    ("control_plane", "control_plane.domain.placements"),
    ("shared", "shared"),  # modules only
])
def test_no_import_cycles_inside(root: str, nested: str) -> None:
    """Every package under `root` (`nested` among them: the graph is the real one) has no cycle among
    its children."""
    graph = grimp.build_graph(root, cache_dir=None)
    packages = sorted(m for m in graph.modules if graph.find_children(m))
    assert nested in packages
    cycles = {p: c for p in packages if (c := sibling_cycles(graph, p))}
    assert cycles == {}
