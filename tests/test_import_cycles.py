"""No import cycle among the project's modules (issue 57: "no import cycle in the project").

The graph: each module of ``PACKAGES`` to each of ours it imports at module level, those under
``if TYPE_CHECKING:`` included (a cycle for the type checker is a cycle for a reader); imports
inside a function are deliberate late ones and not counted. ``from package import name`` is
an edge to ``package.name`` when that is a module, else to the package.

A cycle is a strongly connected set of two or more modules: there is none. (A package's
``__init__`` that re-exports its modules is not an edge from a module importing a sibling
through the package: ``from package import module`` is an edge to ``module`` only.)
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final

ROOT = Path(__file__).resolve().parents[1]
PACKAGES: Final = ("policies", "backends", "gateway", "tools", "loadtest")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _top_level(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield from _top_level(node)  # ``if TYPE_CHECKING:``, ``try:``


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours ``name`` imports at module level."""

    def ours(candidate: str) -> str | None:
        while candidate and candidate not in known:
            candidate = candidate.rpartition(".")[0]
        return candidate or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _top_level(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        out.update(m for t in targets if (m := ours(t)) is not None and m != name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected sets of two or more modules (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root, first in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(first)))]
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
                members = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    members.add(top)
                    if top == node:
                        break
                if len(members) > 1:
                    found.append(frozenset(members))
    return found


def project_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_the_cycle_finder_finds_a_cycle_and_nothing_else() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    found = sorted(sorted(c) for c in cycles(project_graph()))
    assert found == [], f"import cycles (TYPE_CHECKING imports count): {found}"
