"""The three packages import in one direction: routing -> nothing, optimizers -> nothing, optzoo -> both."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_THIRD_PARTY = {
    "routing": {"torch"},
    "optimizers": {"torch", "emerging_optimizers"},
}
FORBIDDEN_FIRST_PARTY = {"routing": {"optzoo", "optimizers"}, "optimizers": {"optzoo", "routing"}}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ["routing", "optimizers"])
def test_lower_layers_import_only_stdlib_torch_and_themselves(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        imported = _imports(path) - {package, "__future__"}
        assert not imported & FORBIDDEN_FIRST_PARTY[package], f"{path}: imports {imported & FORBIDDEN_FIRST_PARTY[package]}"
        third_party = {name for name in imported if name not in sys.stdlib_module_names}
        assert third_party <= ALLOWED_THIRD_PARTY[package], f"{path}: imports {third_party}"


def test_emerging_optimizers_is_imported_only_through_the_adapter() -> None:
    users = [
        path.relative_to(ROOT).as_posix()
        for package in ("optzoo", "routing", "optimizers")
        for path in (ROOT / package).rglob("*.py")
        if "emerging_optimizers" in _imports(path)
    ]
    assert users == ["optimizers/_emerging.py"]
