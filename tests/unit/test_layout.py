"""The layout's rules, checked on the source: pure cores, layers one way, no cycle, threads
started by `start()`, rooms of one role.

Every import counts: at module level, inside functions, and under `TYPE_CHECKING` (a
deferred import is still a dependency, and a cycle closed through one is still a cycle).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "omni_runtime"

MAX_ROOMS = 24
"""Rooms of the package (a folder or a top-level module is one): a room per process and
per shared kit, not per file."""
MAX_ROOM_EDGES = 95
"""Import edges between rooms, deferred imports included."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _owning_module(name: str) -> str | None:
    """The package module `name` is, or lives in (`pkg.mod.Class` → `pkg.mod`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, *, deferred: bool = True) -> set[str]:
    """The package modules `name` imports; with `deferred=False`, only those imported when
    it is imported (not inside functions or under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes: list[ast.AST] = []
    if deferred:
        nodes = list(ast.walk(tree))
    else:
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                nodes.extend(ast.walk(node))
    found: set[str] = set()
    for sub in nodes:
        if isinstance(sub, ast.Import):
            found.update(alias.name for alias in sub.names)
        elif isinstance(sub, ast.ImportFrom):
            module = sub.module or ""
            if sub.level:  # relative: from the importing module's package
                base = package.split(".")[: len(package.split(".")) - (sub.level - 1)]
                module = ".".join([*base, module] if module else base)
            # `from pkg import mod` imports the submodule; `from mod import name`, the module
            submodules = {f"{module}.{a.name}" for a in sub.names} & MODULES.keys()
            found.update(submodules or {module})
    owners = {_owning_module(i) for i in found if i.split(".")[0] == "omni_runtime"}
    return {o for o in owners if o is not None and o != name}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def room(module: str) -> str:
    """`omni_runtime.worker.core` → `worker`; `omni_runtime.keys` → `keys`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


ROOM_EDGES = {(room(a), room(b)) for a, bs in GRAPH.items() for b in bs if room(a) != room(b)}


def layers() -> dict[str, int]:
    """room → layer, from the table in docs/architecture.md's "Layers" section."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    found: dict[str, int] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for name in re.findall(r"`([^`]+)`", cells[2]):
                assert name not in found, f"{name} is on two layers"
                found[name] = int(cells[0])
    return found


def test_core_imports_only_core_and_the_standard_library() -> None:
    for name, path in MODULES.items():
        if not name.startswith("omni_runtime.core"):
            continue
        for imp in imports_of(name, path):
            assert imp.startswith("omni_runtime.core"), f"{name} imports {imp}"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
                tops = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                for top in (t.split(".")[0] for t in tops):
                    allowed = top in sys.stdlib_module_names or top in (
                        "__future__",
                        "omni_runtime",
                    )
                    assert allowed, f"{name} imports {top}"


def test_the_importing_graph_sees_deferred_imports() -> None:
    """A guard on the guard: the graph counts an import made inside a function."""
    assert "omni_runtime.worker.async_engine" in GRAPH["omni_runtime.worker.engines"]
    module_level = imports_of(
        "omni_runtime.worker.engines", MODULES["omni_runtime.worker.engines"], deferred=False
    )
    assert "omni_runtime.worker.async_engine" not in module_level


def test_every_room_is_on_a_layer_and_no_import_runs_upward() -> None:
    layer = layers()
    rooms = {room(m) for m in MODULES}
    assert not rooms - layer.keys(), (
        f"rooms on no layer (docs/architecture.md): {rooms - layer.keys()}"
    )
    assert not layer.keys() - rooms, f"layers name rooms that do not exist: {layer.keys() - rooms}"
    upward = sorted(
        f"{a} -> {b}"
        for name, imports in GRAPH.items()
        for imp in imports
        if layer[(a := room(name))] < layer[(b := room(imp))]
    )
    assert not upward, f"imports from a lower layer to a higher one: {upward}"


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


def test_rooms_and_the_edges_between_them_stay_few() -> None:
    rooms = {room(m) for m in MODULES}
    assert len(rooms) <= MAX_ROOMS, sorted(rooms)
    assert len(ROOM_EDGES) <= MAX_ROOM_EDGES, sorted(ROOM_EDGES)


STARTS = {"start", "create_task", "ensure_future", "run_in_executor"}
STARTED_BY_CONSTRUCTOR = {"omni_runtime.chunks.adapter.ChunkAdapter"}
"""SPEC §4 makes `ChunkAdapter(...)` its start: its threads run once it is built."""


def test_constructors_start_no_thread_and_no_task() -> None:
    """Threads and tasks start in `start()`, never in `__init__`: a half-built object must
    not run, and whoever builds one decides when it does."""
    found = []
    for name, path in MODULES.items():
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef) or f"{name}.{cls.name}" in STARTED_BY_CONSTRUCTOR:
                continue
            for fn in cls.body:
                if not (isinstance(fn, ast.FunctionDef) and fn.name == "__init__"):
                    continue
                for call in ast.walk(fn):
                    if (
                        isinstance(call, ast.Call)
                        and isinstance(call.func, ast.Attribute)
                        and call.func.attr in STARTS
                    ):
                        found.append(f"{name}.{cls.name}: {ast.unparse(call)}")
    assert not found, found


def test_no_module_is_over_400_lines() -> None:
    """A module has one role, read in one sitting; none passes 400 lines, and none is
    split only to be shorter."""
    for folder in (PACKAGE, ROOT / "benchmarks"):
        for path in folder.rglob("*.py"):
            lines = len(path.read_text().splitlines())
            assert lines <= 400, f"{path.relative_to(ROOT)} has {lines} lines"


BROAD = {"Exception", "BaseException"}


def _is_broad(node: ast.expr | None) -> bool:
    """`except:`, `except Exception`, `except BaseException`, or a tuple naming either."""
    if node is None:
        return True
    names = node.elts if isinstance(node, ast.Tuple) else [node]
    return any(isinstance(n, ast.Name) and n.id in BROAD for n in names)


def broad_handlers(package: Path = PACKAGE) -> list[tuple[str, int, bool]]:
    """Every place that catches everything: (file, line, whether a comment on its line or
    the line above says why). `contextlib.suppress(Exception)` counts as one too."""
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.ExceptHandler):
                broad = _is_broad(node.type)
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("suppress"):
                broad = any(_is_broad(arg) for arg in node.args)
            else:
                continue
            if broad:
                line = lines[node.lineno - 1]
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                said = "#" in line or above.startswith("#")
                found.append((path.name, node.lineno, said))
    return found


MAX_BROAD_EXCEPTS = 16
"""Places that catch everything: where foreign code runs (`core/foreign.py`), where one
request's (or one WebSocket session's) failure is contained, and a few thread and process
shells."""


def test_broad_excepts_are_few_and_each_says_why_it_must_be_broad() -> None:
    """A broad `except` only at a boundary (foreign code, a request contained, a thread or
    process shell), with a comment on its line or the line above saying why; elsewhere a
    handler names what can arrive. A cleanup that re-raises is a `finally`."""
    found = broad_handlers()
    assert len(found) <= MAX_BROAD_EXCEPTS, [f"{f}:{n}" for f, n, _ in found]
    assert not [f"{f}:{n}" for f, n, said in found if not said]


def test_the_broad_except_count_sees_every_form(tmp_path: Path) -> None:
    (tmp_path / "forms.py").write_text(
        "import contextlib\n"
        "try:\n    pass\nexcept:  # 3\n    pass\n"
        "try:\n    pass\nexcept Exception:\n    pass\n"
        "try:\n    pass\n# 11: said above\nexcept BaseException as e:\n    pass\n"
        "try:\n    pass\nexcept (OSError, Exception):\n    pass\n"
        "with contextlib.suppress(ValueError, Exception):\n    pass\n"
        "try:\n    pass\nexcept (OSError, ValueError):  # narrow: not counted\n    pass\n"
        "with contextlib.suppress(OSError):\n    pass\n"
    )
    assert broad_handlers(tmp_path) == [
        ("forms.py", 4, True),
        ("forms.py", 8, False),
        ("forms.py", 13, True),
        ("forms.py", 17, False),
        ("forms.py", 19, False),
    ]


READS_THE_ENVIRONMENT = {
    "omni_runtime.settings": "the one place settings are read (`OMNI_*`)",
    "omni_runtime.cli": "the entry point: `OMNI_SETTINGS_FILE`",
    "omni_runtime.local.launcher": "hands its environment to the processes it starts",
    "omni_runtime.local.forked": "gives each forked child its own environment",
    "omni_runtime.local.redis_server": "`OMNI_REDIS_SERVER`, the binary a local deployment runs",
    "omni_runtime.observe.start": "OpenTelemetry's own `OTEL_*` variables, read as its SDK does",
    "omni_runtime.observe.otel": "OpenTelemetry's own `OTEL_*` variables, read as its SDK does",
    "omni_runtime.orchestrator.proc": "a process shell: the watchdog's fault-test hook",
}
"""Modules that read `os.environ`, and why: every other one gets its settings from its
process shell, through its constructor."""
BUILDS_SETTINGS = {"omni_runtime.settings", "omni_runtime.cli", "omni_runtime.http.settings"}


def test_settings_come_from_the_shell_not_the_environment() -> None:
    """Below the entry point and the shells, no module reads the environment or builds its
    own `Settings`: a component is handed what it needs."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            reads = (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in ("environ", "getenv", "environb")
            )
            builds = (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "Settings"
            )
            if reads and name not in READS_THE_ENVIRONMENT:
                found.append(f"{name} reads the environment")
            if builds and name not in BUILDS_SETTINGS:
                found.append(f"{name} builds Settings")
    assert not found, found


TAKES_SETTINGS = {
    "omni_runtime.cli": "the entry point: builds `Settings` from flags, file and environment",
    "omni_runtime.cli.commands": "the entry point's commands: each hands `Settings` to a shell",
    "omni_runtime.local.launcher": "hands every setting to the processes it starts",
    "omni_runtime.orchestrator.proc": "the orchestrator's process shell",
    "omni_runtime.worker.proc": "a stage worker's process shell",
    "omni_runtime.client.client": "the client's shell (`OmniClient`), in its own process or another",
    "omni_runtime.client.loadgen": "`omni-runtime bench`: an entry point running an `OmniClient`",
    "omni_runtime.http.serve": "the front door's process shell",
    "omni_runtime.http.gateway": "the front door's shell: a client per pipeline, in its namespace",
    "omni_runtime.ops.status": "`omni-runtime status`: an operator command, a shell of its own",
    "omni_runtime.ops.dead_letters": "`omni-runtime dead-letters`: an operator command",
    "omni_runtime.ops.trace_view": "`omni-runtime trace`: an operator command",
}
"""Modules that import `Settings`, and why: the entry points and the process shells. Every
part below a shell is handed what it needs through its constructor (loose values, or its
own frozen dataclass that the shell takes with `Settings.part`)."""


def test_only_the_shells_take_the_whole_settings() -> None:
    """A constructor says what its part depends on: no part reaches into `Settings`."""
    takers = {name for name, imports in GRAPH.items() if "omni_runtime.settings" in imports}
    assert not takers - TAKES_SETTINGS.keys(), (
        f"parts importing Settings: {takers - TAKES_SETTINGS.keys()}"
    )
    assert not TAKES_SETTINGS.keys() - takers, (
        f"listed, no longer import it: {TAKES_SETTINGS.keys() - takers}"
    )


def test_the_settings_check_sees_deferred_and_type_checking_imports(tmp_path: Path) -> None:
    (tmp_path / "typed.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from omni_runtime.settings import Settings\n"
    )
    (tmp_path / "deferred.py").write_text("def f():\n    from omni_runtime import settings\n")
    for name in ("typed", "deferred"):
        found = imports_of(f"omni_runtime.{name}", tmp_path / f"{name}.py")
        assert found == {"omni_runtime.settings"}, name
