"""The README's quick start is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_test_command_is_the_one_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    match = re.search(r'^TEST_CMD="(.+)"$', ci, re.MULTILINE)
    assert match, "TEST_CMD not found in .ci/run"
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("##", 1)[0]
    assert match.group(1) in quick_start.splitlines()


def test_readme_run_command_uses_a_bundled_pipeline() -> None:
    readme = (ROOT / "README.md").read_text()
    run = re.search(r"omni-runtime run --pipeline (\S+)", readme)
    assert run and (ROOT / run.group(1)).is_file()


def test_readme_python_snippets_run_as_pasted() -> None:
    """Every ```python block compiles as a script (no top-level `async with`)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert blocks
    for block in blocks:
        compile(block, "README.md", "exec")
