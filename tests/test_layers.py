"""Every import points down: a module imports its own package or the floors below it.

    5  kvswitch.app                        the kvswitch command, the demo, generate
    4  kvswitch.benchmarks, kvswitch.loadtest
    3  kvswitch.deploy                     a local cluster of processes
    2  kvswitch.router, kvswitch.worker
    1  kvswitch.cache_index, kvswitch.kernels, kvswitch.client
    0  kvswitch (its own modules), kvswitch.v1   the protocol and shared helpers

Packages on one floor do not import each other: the router and the worker meet only through the
protocol. ``python -m kvswitch`` (kvswitch/__main__.py) is the one way in from the ground floor.
"""

from __future__ import annotations

import ast
import gc
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FLOORS = {
    "kvswitch": 0,
    "kvswitch.v1": 0,
    "kvswitch.cache_index": 1,
    "kvswitch.kernels": 1,
    "kvswitch.client": 1,
    "kvswitch.router": 2,
    "kvswitch.worker": 2,
    "kvswitch.deploy": 3,
    "kvswitch.benchmarks": 4,
    "kvswitch.loadtest": 4,
    "kvswitch.app": 5,
}
ENTRY_POINTS = {"kvswitch.__main__"}


def _package_dirs() -> dict[str, Path]:
    """Each installed package's folder, from pyproject's package-dir map."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}
    for name in setuptools["packages"]:
        if name not in dirs:
            parent, _, leaf = name.rpartition(".")
            dirs[name] = dirs[parent] / leaf
    return dirs


def _package_of(module: str) -> str:
    """The floor-owning package of a dotted module name."""
    parts = module.split(".")
    if len(parts) >= 2 and ".".join(parts[:2]) in FLOORS:
        return ".".join(parts[:2])
    return "kvswitch"


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in _package_dirs().items():
        for path in folder.glob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for each kvswitch import in the file, lazy ones included."""
    found = []
    # NOTE: no collection while the tree is built: a finalizer it runs there (a coroutine an
    # earlier test left on a closed loop, warning as it goes) trips CPython 3.11's check of the
    # AST's recursion depth ("AST constructor recursion depth mismatch").
    gc.disable()
    try:
        tree = ast.parse(path.read_text(), str(path))
    finally:
        gc.enable()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "kvswitch":
                found += [(node.lineno, f"kvswitch.{alias.name}") for alias in node.names]
            elif node.module.startswith("kvswitch."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("kvswitch.")]
    return found


def test_every_package_has_a_floor():
    assert set(_package_dirs()) == set(FLOORS)


def test_every_import_points_down():
    upward = []
    for module, path in sorted(_modules().items()):
        if module in ENTRY_POINTS:
            continue
        home = _package_of(module)
        for line, imported in _imports(path):
            target = _package_of(imported)
            if target != home and FLOORS[target] >= FLOORS[home]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({home}) imports {imported}")
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


@pytest.mark.parametrize(
    ("module", "package"),
    [
        ("kvswitch.metrics", "kvswitch"),
        ("kvswitch.v1.router_pb2", "kvswitch.v1"),
        ("kvswitch.app.cli", "kvswitch.app"),
        ("kvswitch.worker.engine", "kvswitch.worker"),
    ],
)
def test_modules_are_placed_on_their_packages_floor(module, package):
    assert _package_of(module) == package


def test_an_upward_import_is_found(tmp_path):
    upward = tmp_path / "upward.py"
    upward.write_text("def f():\n    from kvswitch.app import cli\n\nfrom kvswitch import demo\n")
    assert sorted(_imports(upward)) == [(2, "kvswitch.app"), (4, "kvswitch.demo")]
