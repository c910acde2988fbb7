"""The repository's shape: the README's layout table names every package folder, imports point
one way (``policies`` <- ``backends`` <- ``gateway`` <- ``tools``, ``loadtest``), and nothing
reaches outside the clone."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("policies", "backends", "gateway", "tools", "loadtest")

# What each top-level package may import of ours.
ALLOWED: dict[str, frozenset[str]] = {
    "policies": frozenset({"policies"}),
    "backends": frozenset({"backends", "policies"}),
    "gateway": frozenset({"gateway", "backends", "policies"}),
    "tools": frozenset({"tools", "gateway", "backends", "policies"}),
    "loadtest": frozenset({"loadtest", "tools", "gateway", "backends", "policies"}),
}
# The only imports against the grain, each inside a function, so importing the gateway never
# imports them: the console script's subcommands.
LAZY_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset(
    {
        ("gateway/cli.py", "tools"),
        ("gateway/cli.py", "loadtest"),
    }
)


def package_folders() -> list[str]:
    return sorted(
        init.parent.relative_to(ROOT).as_posix() + "/"
        for package in PACKAGES
        for init in (ROOT / package).rglob("__init__.py")
        if "__pycache__" not in init.parts
    )


def readme_layout_paths() -> set[str]:
    text = (ROOT / "README.md").read_text()
    return set(re.findall(r"^\| `([\w/]+/)` \|", text, flags=re.MULTILINE))


def test_readme_layout_table_names_every_package_folder() -> None:
    folders = package_folders()
    assert len(folders) > len(PACKAGES)  # the walk found the subpackages
    missing = [f for f in folders if f not in readme_layout_paths()]
    assert missing == [], f"package folders the README's layout table does not name: {missing}"


def test_readme_layout_table_names_only_folders_that_exist() -> None:
    stale = [p for p in readme_layout_paths() if not (ROOT / p).is_dir()]
    assert stale == [], f"the README's layout table names folders that are gone: {stale}"


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """Every top-level package ``path`` imports, and whether the import is inside a function."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                found.extend((alias.name.split(".")[0], inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module.split(".")[0], inner))
            visit(child, inner)

    visit(tree, False)
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package: str) -> None:
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for imported, nested in imports_of(path):
            if imported not in PACKAGES or imported in ALLOWED[package]:
                continue
            if nested and (rel, imported) in LAZY_EXCEPTIONS:
                continue
            wrong.append(f"{rel} imports {imported}")
    assert wrong == []


def test_the_lazy_exceptions_are_still_needed_and_lazy() -> None:
    for rel, imported in sorted(LAZY_EXCEPTIONS):
        kinds = {nested for name, nested in imports_of(ROOT / rel) if name == imported}
        assert kinds == {True}, f"{rel}: {imported} imported {kinds or 'nowhere'}"


def test_nothing_names_a_folder_outside_the_clone() -> None:
    outside = "../" + "shared"  # not written whole, or this file would name it
    listed = subprocess.run(
        ["git", "grep", "-l", "-F", outside], check=False, cwd=ROOT, capture_output=True, text=True
    )
    if listed.returncode not in (0, 1):
        pytest.skip("not a git checkout")
    assert listed.stdout.split() == []


# The request path's modules in the order control goes down (``gateway/request/proxy.py``'s
# docstring): each may import only those after it, so none calls back up into one before it.
REQUEST_PATH = ("proxy", "resume", "attempt", "answer", "send", "relay", "call")


def request_path_imports(stage: str) -> set[str]:
    tree = ast.parse((ROOT / "gateway" / "request" / f"{stage}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gateway.request."):
            found.add(str(node.module).rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            found.update(n.rsplit(".", 1)[1] for n in names if n.startswith("gateway.request."))
    return found & set(REQUEST_PATH)


@pytest.mark.parametrize("stage", REQUEST_PATH)
def test_the_request_path_calls_only_down(stage: str) -> None:
    after = set(REQUEST_PATH[REQUEST_PATH.index(stage) + 1 :])
    upward = request_path_imports(stage) - after
    assert upward == set(), f"gateway/request/{stage}.py imports {sorted(upward)}, which come first"
