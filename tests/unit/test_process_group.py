"""ProcessGroup, with fake processes: with OMNI_METRICS_PORT set, every process it starts
gets a port of its own, and keeps it when `restart_dead` starts it again, as a worker
that replaces the dead one; how often a process may die before the group gives up."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from omni_runtime.cli import process_id
from omni_runtime.errors import FatalError
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


class DyingPopen:
    """A process that runs until the test says it died (`code`)."""

    started: ClassVar[list[DyingPopen]] = []

    def __init__(self, cmd: list[str], env: dict[str, str], **_kw: Any) -> None:
        self.cmd, self.env = cmd, env
        self.code: int | None = None
        self.returncode: int | None = None
        self.started.append(self)

    def poll(self) -> int | None:
        return self.code

    def wait(self, _timeout: float | None = None) -> int:
        self.returncode = self.code = self.code if self.code is not None else 0
        return self.code

    def send_signal(self, _sig: int) -> None:
        pass


def test_a_dead_process_is_started_again_in_its_place_and_a_crash_loop_stops_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(subprocess, "Popen", DyingPopen)
    DyingPopen.started.clear()
    group = ProcessGroup(OMNI, load_pipeline(OMNI), {"OMNI_METRICS_PORT": "9400"})
    group.start()
    try:
        assert group.restart_dead(now=0.0) == []
        for died_at in (0.0, 10.0, 20.0, 61.0):  # the one at 0 is out of the window at 61
            talker = group.procs[2][1]
            assert isinstance(talker, DyingPopen)
            talker.code = -9
            assert group.restart_dead(now=died_at) == ["stage1-talker-0"]
            again = group.procs[2][1]
            assert again is not talker and isinstance(again, DyingPopen)
            assert again.env["OMNI_METRICS_PORT"] == "9402"
            dead_name = talker.cmd[talker.cmd.index("--worker-id") + 1]
            new_name = again.cmd[again.cmd.index("--worker-id") + 1]
            assert new_name != dead_name and new_name == group.process_ids["stage1-talker-0"]
            assert again.cmd[again.cmd.index("--replaces") + 1] == dead_name
            assert (
                again.cmd[: talker.cmd.index("--worker-id")]
                == talker.cmd[: talker.cmd.index("--worker-id")]
            )
        assert [name for name, _p, _f in group.procs][2] == "stage1-talker-0"
        assert len(DyingPopen.started) == 4 + 4
        dying = group.procs[2][1]
        assert isinstance(dying, DyingPopen)
        dying.code = 3
        with pytest.raises(
            FatalError, match=r"stage1-talker-0 exited with code 3 and died 4 times"
        ):
            group.restart_dead(now=62.0)
    finally:
        group.stop()


def test_the_restart_limit_is_never_below_the_deliveries_a_poison_input_gets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With OMNI_MAX_DELIVERIES=5, a request that kills whoever runs it does so 5 times
    before it is dead-lettered: those 5 deaths are no crash loop."""
    monkeypatch.setattr(subprocess, "Popen", DyingPopen)
    group = ProcessGroup(OMNI, load_pipeline(OMNI), {"OMNI_MAX_DELIVERIES": "5"})
    group.start()
    try:
        for died_at in range(6):
            dying = group.procs[1][1]
            assert isinstance(dying, DyingPopen)
            dying.code = -9
            if died_at == 5:
                with pytest.raises(FatalError, match="died 6 times"):
                    group.restart_dead(now=float(died_at))
            else:
                assert group.restart_dead(now=float(died_at)) == ["stage0-thinker-0"]
    finally:
        group.stop()


def test_a_stage_named_in_free_text_still_gives_its_worker_a_valid_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A stage's name is any text up to 64 characters (a '/' in it once made `run` fail to
    open the process's log); the process's log file and name in Redis (checked by
    `cli.process_id`) are made of what passes."""
    monkeypatch.setattr(subprocess, "Popen", DyingPopen)
    raw = yaml.safe_load(OMNI.read_text())
    raw["stages"][1]["name"] = "my talker: ünïcode/äöü " + "x" * 40
    path = tmp_path / "named.yaml"
    path.write_text(yaml.safe_dump(raw))
    group = ProcessGroup(path, load_pipeline(path), {})
    group.start()
    try:
        talker = group.procs[2][1]
        assert isinstance(talker, DyingPopen)
        given = talker.cmd[talker.cmd.index("--worker-id") + 1]
        assert process_id(given) == given and given.startswith("stage1-my_talker__")
        assert (group.log_dir / f"{group.procs[2][0]}.log").exists()
    finally:
        group.stop()
