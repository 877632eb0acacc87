"""``kvswitch bench serve``'s reference run takes the torch references for every kernel.

On a GPU every ``use_triton`` says yes; the reference run must still call no Triton launcher, or
the served output would be compared with the kernels that produced it.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from kvswitch import kernels
from kvswitch.benchmarks.serve import USE_TRITON_MODULES, ServeBenchConfig, _reference_gaps

ROOT = Path(__file__).resolve().parents[1]


def _binds_use_triton(node: ast.AST) -> bool:
    if isinstance(node, ast.FunctionDef):
        return node.name == "use_triton"
    if isinstance(node, ast.ImportFrom):
        return any((alias.asname or alias.name) == "use_triton" for alias in node.names)
    return False


def _modules_binding_use_triton() -> set[str]:
    """Every module of the package whose source defines ``use_triton`` or imports it by name."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in setuptools["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            if any(_binds_use_triton(node) for node in ast.walk(tree)):
                parts = path.relative_to(ROOT / folder).with_suffix("").parts
                found.add(".".join((package, *parts)).removesuffix(".__init__"))
    return found


def test_every_module_that_binds_use_triton_is_patched() -> None:
    found = _modules_binding_use_triton()
    assert {"kvswitch.worker.attention", "kvswitch.worker.model"} <= found  # the scan works
    assert set(USE_TRITON_MODULES) == found


def _gaps() -> list[float]:
    config = ServeBenchConfig(num_prompts=1, num_prompt_tokens=20, num_shared_tokens=0)
    prompt = [256, *b"the reference decides"][:20]
    records = [{"prompt": 0, "token_ids": [7, 101, 33, 250, 9]}]
    _reference_gaps(config, records, [prompt])
    return records[0]["gaps"]


def test_the_reference_run_calls_no_kernel_where_every_switch_says_triton(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    want = _gaps()  # CPU: every switch already says references
    for module in _modules_binding_use_triton():
        monkeypatch.setattr(f"{module}.use_triton", lambda device: True)
    for name in kernels._LAUNCHERS:

        def launcher(*args, _name=name, **kwargs):
            raise AssertionError(f"the reference run launched {_name}")

        monkeypatch.setattr(kernels, name, launcher)
    assert _gaps() == want
    assert len(want) == 5 and min(want) >= 0.0
