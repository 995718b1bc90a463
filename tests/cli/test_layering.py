"""gemctl's modules import each other without cycles (imports inside functions included), and
gemctl sits on top: nothing in gem_platform or gem_kernels imports it, nor the measuring
packages gem_bench and gem_profile (which only the top floor imports)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.cli.conftest import REPO


def _imports(path: Path, package: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == package:  # from gemctl import render, sweep
                found |= {f"{package}.{a.name}" for a in node.names}
            elif node.module.startswith(package + "."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(package + ".")}
    return found


def test_gemctl_has_no_import_cycles():
    graph = {f"gemctl.{p.stem}": _imports(p, "gemctl") for p in (REPO / "gemctl").glob("*.py")}
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == 1:
            raise AssertionError("import cycle: " + " -> ".join([*path, module]))
        if state.get(module) == 2:
            return
        state[module] = 1
        for dep in sorted(graph[module]):
            visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        visit(module, [])


def test_nothing_below_imports_gemctl():
    for root in ("platform", "kernels"):
        for path in (REPO / root).rglob("*.py"):
            assert not _imports(path, "gemctl"), path
            assert "import gemctl" not in path.read_text(), path


def test_nothing_below_imports_the_benchmarks():
    for root in ("platform", "kernels"):
        for path in (REPO / root).rglob("*.py"):
            for package in ("gem_bench", "gem_profile"):
                assert not _imports(path, package), path
                assert f"import {package}" not in path.read_text(), path


def test_gemctl_imports_the_measuring_packages_only_where_a_command_runs():
    """gemctl is their one importer, and only inside the commands that use them: the CLI's
    other commands start without loading a benchmark or the profiler."""
    for path in (REPO / "gemctl").glob("*.py"):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in names if m.split(".")[0] in ("gem_bench", "gem_profile")}, path



def test_commands_are_registered_one_way():
    """Every command is added by its module's register(app): no module decorates a function
    with app.command, and main.py registers every module that has a register function."""
    main = (REPO / "gemctl" / "main.py").read_text()
    for path in (REPO / "gemctl").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                for deco in node.decorator_list:
                    call = deco.func if isinstance(deco, ast.Call) else deco
                    assert not (isinstance(call, ast.Attribute) and call.attr == "command"), \
                        f"{path.name}: {node.name} is registered by a decorator"
        if any(isinstance(n, ast.FunctionDef) and n.name == "register" for n in tree.body):
            assert f"    {path.stem},\n" in main, f"main.py does not register {path.stem}"
