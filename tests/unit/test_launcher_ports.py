"""ProcessGroup: with OMNI_METRICS_PORT set, every process it starts gets a port of its own."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, ClassVar

import pytest

from omni_runtime.local.launcher import ProcessGroup
from omni_runtime.pipeline import load_pipeline

OMNI = Path(__file__).resolve().parents[2] / "workers" / "omni.yaml"


class FakePopen:
    envs: ClassVar[list[dict[str, str]]] = []
    returncode = 0

    def __init__(self, cmd: list[str], env: dict[str, str], **_kw: Any) -> None:
        self.envs.append(env)

    def poll(self) -> int:
        return 0

    def wait(self, _timeout: float | None = None) -> int:
        return 0


@pytest.mark.parametrize(("given", "expected"), [("9400", [9400, 9401, 9402, 9403]), ("0", None)])
def test_each_process_gets_its_own_metrics_port(
    monkeypatch: pytest.MonkeyPatch, given: str, expected: list[int] | None
) -> None:
    monkeypatch.setattr(subprocess, "Popen", FakePopen)  # what the launcher calls
    FakePopen.envs.clear()
    group = ProcessGroup(OMNI, load_pipeline(OMNI), {"OMNI_METRICS_PORT": given})
    group.start()
    try:
        envs = FakePopen.envs
        names = [name for name, _proc, _log in group.procs]
        assert names[0] == "orchestrator" and len(names) == 4
        if expected is None:
            assert {e["OMNI_METRICS_PORT"] for e in envs} == {"0"} and not group.metrics_ports
        else:
            assert [int(e["OMNI_METRICS_PORT"]) for e in envs] == expected
            assert list(group.metrics_ports.values()) == expected
    finally:
        group.stop()
