"""The repository's shape: the README's layout table names every package folder, ``tests/``
mirrors the package folders, imports point one way (``policies`` <- ``backends`` <- ``gateway``
<- ``tools``, ``loadtest``), no class or type alias name is defined twice in the product, and
nothing reaches outside the clone."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
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


def test_every_package_folder_has_its_tests_in_the_mirror_folder() -> None:
    """A test lives in the folder of ``tests/`` that mirrors the folder of the code it tests;
    so each package folder has that folder, holding tests of its own."""
    missing = [f for f in package_folders() if not any((TESTS / f).glob("test_*.py"))]
    assert missing == [], (
        f"package folders with no tests/<folder>/test_*.py of their own: {missing}; "
        "create the mirror folder (with an __init__.py) and move or write its tests there"
    )


def test_every_folder_of_tests_is_a_package() -> None:
    """Each test module is imported by its dotted path (``tests.gateway.request.test_x``), so
    folders may hold files of the same name, as their packages may."""
    loose = sorted(
        {
            path.parent.relative_to(ROOT).as_posix()
            for path in TESTS.rglob("*.py")
            if "__pycache__" not in path.parts and not (path.parent / "__init__.py").is_file()
        }
    )
    assert loose == [], f"folders of tests without an __init__.py: {loose}"


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


# The packages a reader of the product meets; tools/ and loadtest/ are its helpers.
PRODUCT = ("policies", "backends", "gateway")


def type_names_of(path: Path) -> list[str]:
    """The types ``path`` defines at module level: its classes and its type aliases, written
    ``X: TypeAlias = ...`` or ``X = ...`` with a CapWords name (constants are UPPER_CASE)."""
    found = []
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.ClassDef):
            found.append(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if ast.unparse(node.annotation).rsplit(".", 1)[-1] == "TypeAlias":
                found.append(node.target.id)
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            found.extend(n for n in names if n[0].isupper() and not n.isupper())
    return found


def test_no_type_name_is_defined_twice_in_the_product() -> None:
    """One name, one thing: a reader meeting ``Lease`` or ``Decision`` in the product need not
    ask which module it came from (issue 57)."""
    where: dict[str, list[str]] = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for name in type_names_of(path):
                where.setdefault(name, []).append(rel)
    twice = {name: paths for name, paths in sorted(where.items()) if len(paths) > 1}
    assert twice == {}, "class or type alias names defined more than once in {}:\n{}".format(
        "/".join(PRODUCT),
        "\n".join(f"  {name}: {', '.join(paths)}" for name, paths in twice.items())
        + "\nrename the one whose name says less of what it is",
    )
