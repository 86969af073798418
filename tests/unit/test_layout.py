"""The layout's rules, checked on the source: pure cores, arrows one way, no cycle, small rooms."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "omni_runtime"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULE_NAMES = {module_name(p) for p in PACKAGE.rglob("*.py")}


def module_level_imports(path: Path) -> set[str]:
    """What a module imports when it is imported (not inside functions or TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, ast.FunctionDef | ast.ClassDef) else []:
            if isinstance(sub, ast.Import):
                found.update(alias.name for alias in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                # `from pkg import mod` imports the submodule; `from mod import name`, the module
                subs = {f"{sub.module}.{alias.name}" for alias in sub.names}
                submodules = {m for m in subs if m in MODULE_NAMES}
                found.update(submodules or {sub.module})
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {
    name: {imp for imp in module_level_imports(path) if imp in MODULES and imp != name}
    for name, path in MODULES.items()
}


def test_core_imports_only_core_and_the_standard_library() -> None:
    for name, path in MODULES.items():
        if not name.startswith("omni_runtime.core"):
            continue
        for imp in module_level_imports(path):
            top = imp.split(".")[0]
            if top == "omni_runtime":
                assert imp.startswith("omni_runtime.core"), f"{name} imports {imp}"
            else:
                assert top in sys.stdlib_module_names or top == "__future__", f"{name}: {imp}"


def test_the_chunk_plane_and_the_redis_kit_do_not_import_the_process_shells() -> None:
    shells = ("omni_runtime.worker", "omni_runtime.orchestrator_proc", "omni_runtime.client")
    for name, imports in GRAPH.items():
        if name.startswith(("omni_runtime.chunks", "omni_runtime.redis_io")):
            assert not [i for i in imports if i.startswith(shells)], name


def test_no_import_cycle_in_the_package() -> None:
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = [*path[path.index(name) :], name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for imp in sorted(GRAPH[name]):
            visit(imp, [*path, name])
        done.add(name)

    for name in sorted(GRAPH):
        visit(name, [])


def test_no_module_is_over_450_lines() -> None:
    """A module has one role, read in one sitting; few pass 400 lines, none 450, and none is
    split only to be shorter."""
    for folder in (PACKAGE, ROOT / "benchmarks"):
        for path in folder.rglob("*.py"):
            lines = len(path.read_text().splitlines())
            assert lines <= 450, f"{path.relative_to(ROOT)} has {lines} lines"
