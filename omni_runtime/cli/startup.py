"""What a command-line process imports at start, and how: its start-up is part of every
`omni-runtime` command, and of `run`'s ~1 s from the command to the first output."""

from __future__ import annotations

import ast
import inspect
import itertools
import sys
from pathlib import Path
from typing import Any


def import_redis() -> None:
    """Import redis-py without the OpenTelemetry SDK, which redis-py imports when it is
    installed (~0.1 s of a process's start) for client metrics of its own that nothing
    here turns on. The runtime's trace export (`observe.otel`) imports what it uses itself,
    and the SDK stays importable: it is hidden for this one import only."""
    hidden = "opentelemetry.sdk.metrics"
    if "redis" in sys.modules or hidden in sys.modules:
        return
    sys.modules[hidden] = None  # type: ignore[assignment]  # "not installed", for this import
    try:
        import redis.asyncio  # noqa: F401
    finally:
        del sys.modules[hidden]


_DOCUMENTED: set[type[Any]] = set()


def document_fields(model: type[Any]) -> None:
    """Give each field of the pydantic `model` that has no description its attribute
    docstring (what `--help` shows). pydantic's `use_attribute_docstrings` finds the
    class's source by walking the importing frames through `inspect.getmodule`, ~0.1 s of
    every process's import; this reads the module's file, once a parser needs it."""
    if model in _DOCUMENTED:
        return
    _DOCUMENTED.add(model)
    module_file = getattr(sys.modules.get(model.__module__), "__file__", None)
    try:
        tree = ast.parse(Path(module_file or "").read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return  # no source: the flags go without help text
    body = next(
        (n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == model.__name__),
        [],
    )
    fields = model.model_fields
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
            and node.target.id in fields
            and fields[node.target.id].description is None
        ):
            fields[node.target.id].description = inspect.cleandoc(after.value.value)
