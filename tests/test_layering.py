"""The import graph of the one installed package, ``optzoo``, and the rules it keeps.

Every ``import`` and ``from ... import`` of every module (inside functions too, since a lazy
import still makes a cycle; not under ``if TYPE_CHECKING:``), resolved to module names, makes
one directed graph. The repository's top-level ``routing/`` and ``optimizers/`` folders are
``optzoo.routing`` and ``optzoo.optimizers`` (the build maps them there).

- No cycles.
- Layers: ``optzoo.routing`` and ``optzoo.optimizers`` import only the standard library, torch,
  themselves and ``optzoo._common`` (the bottom module, which imports only the standard library
  and torch); ``optzoo.optimizers`` may also import ``emerging_optimizers``, through its adapter
  only. Neither imports the other.
- ``optzoo`` never imports ``benchmarks`` or ``tests``, nor edits ``sys.path``; the one exception
  is the ``optzoo`` command's entry point (``optzoo.cli``), which puts the current directory first
  while it builds ``--model package.module:callable``, as ``python -m`` does, and restores it
  (``tests/cli/test_cli.py::test_a_module_in_the_current_directory_is_found``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"optzoo": ROOT / "optzoo", "optzoo.routing": ROOT / "routing", "optzoo.optimizers": ROOT / "optimizers"}
"""Package name -> the folder that holds it (optzoo/routing and optzoo/optimizers are links, skipped)."""


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder).with_suffix("")
            if any(part in ("routing", "optimizers") for part in relative.parts[:1]) and package == "optzoo":
                continue  # the links: their files belong to the other two packages
            parts = [*package.split("."), *relative.parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(module: str) -> set[str]:
    """Every module ``module`` imports, resolved (``from package import submodule`` names the submodule)."""
    tree = ast.parse(MODULES[module].read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = module if _is_package(module) else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                assert node.module is not None  # "from import x" is not Python
                target = node.module
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
    return found


GRAPH = {module: {name for name in imports_of(module) if name in MODULES} for module in MODULES}


def _cycles() -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(GRAPH[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1 or module in GRAPH[module]:
                components.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return components


def test_the_graph_covers_the_three_folders() -> None:
    assert {"optzoo", "optzoo._common", "optzoo.routing.keys", "optzoo.optimizers.muon", "optzoo.wrapper.param_map"} <= set(MODULES)
    assert "optzoo.routing.keys" in GRAPH["optzoo.routing"]  # relative imports resolve
    assert "optzoo.optimizers._emerging" in GRAPH["optzoo.optimizers.registry"]  # "from . import _emerging"


def test_no_import_cycles() -> None:
    assert _cycles() == []


def test_a_cycle_would_be_found() -> None:
    GRAPH["optzoo._common"].add("optzoo.routing._guess")  # which imports _common: now a cycle
    try:
        assert _cycles() == [["optzoo._common", "optzoo.routing._guess"]]
    finally:
        GRAPH["optzoo._common"].discard("optzoo.routing._guess")


LOWER_LAYERS = {
    "optzoo.routing": {"torch"},
    "optzoo.optimizers": {"torch", "emerging_optimizers"},
    "optzoo._common": {"torch"},
}


@pytest.mark.parametrize("layer", sorted(LOWER_LAYERS))
def test_lower_layers_import_only_stdlib_torch_themselves_and_common(layer: str) -> None:
    for module in (m for m in MODULES if m == layer or m.startswith(f"{layer}.")):
        for name in imports_of(module):
            top = name.split(".")[0]
            if top == "optzoo":
                assert name == layer or name.startswith(f"{layer}.") or name == "optzoo._common", f"{module} imports {name}"
            else:
                assert top in sys.stdlib_module_names or top in LOWER_LAYERS[layer] or top == "__future__", f"{module} imports {name}"


def test_optzoo_never_imports_benchmarks_or_tests_nor_edits_sys_path() -> None:
    for module, path in MODULES.items():
        tops = {name.split(".")[0] for name in imports_of(module)}
        assert not tops & {"benchmarks", "tests"}, f"{module} imports {tops & {'benchmarks', 'tests'}}"
        if module != "optzoo.cli":  # a program's entry point, not the library
            assert "sys.path" not in path.read_text(), f"{module} edits sys.path"


def test_emerging_optimizers_is_imported_only_through_the_adapter() -> None:
    users = sorted(m for m in MODULES if any(name.split(".")[0] == "emerging_optimizers" for name in imports_of(m)))
    assert users == ["optzoo.optimizers._emerging"]
