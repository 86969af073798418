"""A stopping orchestrator cuts its blocking reads short, and loses nothing by it.

Over a real redis-server: an orchestrator asked to stop while blocked in XREADGROUP
returns at once instead of after its `block_ms`; a request its cut read was
delivered stays pending for the orchestrator's consumer and is served by the next
orchestrator, which reads it again as backlog.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from omni_runtime import keys
from omni_runtime.local.launcher import child_env
from omni_runtime.orchestrator.proc import OrchestratorService
from omni_runtime.pipeline import load_pipeline
from omni_runtime.redis_io.entries import entry_fields, parse_entries, stream_reply
from omni_runtime.redis_io.write_ops import xadd_fields
from omni_runtime.settings import Settings
from omni_runtime.wire.messages import OrchOutputMsg, RequestMsg
from tests.e2e.serving import ROOT
from tests.waiting import wait_for, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]

SEED = ROOT / "workers" / "seed.yaml"
LONG_BLOCK_MS = 4_000
"""Reads block this long (below redis-py's 5 s socket timeout): a stop that waited for
reads just begun would take about this long."""
STOP_BOUND_S = 2.0
"""Well under `LONG_BLOCK_MS`, and far above a cut read's few milliseconds."""
READERS = 4
"""The orchestrator's blocking reads on a single server: its requests, one joint read of
every stage's outputs (`redis_io/joint_read.py`), the control stream's (its
malformed entries are dead-lettered: `orchestrator/control.py`), and the released-slots
stream's (a slot given up is taken over at once: `Leases.follow_releases`)."""


class Processes:
    """Real OS processes of `omni-runtime`, in one namespace, stopped at the end."""

    def __init__(self, redis_url: str, tmp_path: Path) -> None:
        self.namespace = f"x{uuid.uuid4().hex[:8]}"
        self.env = child_env(redis_url, {"OMNI_NAMESPACE": self.namespace})
        self.settings = Settings(
            redis_url=redis_url, namespace=self.namespace, block_ms=LONG_BLOCK_MS
        )
        self.tmp_path = tmp_path
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        log = self.tmp_path / f"{len(self.procs)}-{args[0]}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "omni_runtime.cli", *args, "--pipeline", str(SEED)],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs.append((proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')}" for _p, log in self.procs
        )

    def stop(self) -> None:
        for proc, _log in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _log in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def processes(redis_url: str, tmp_path: Path) -> Iterator[Processes]:
    p = Processes(redis_url, tmp_path)
    try:
        yield p
    finally:
        p.stop()


def wait_key(client: redis.Redis, pattern: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not client.keys(pattern):
        assert time.monotonic() < end, f"no {pattern} before the deadline"
        time.sleep(0.02)


def test_an_idle_orchestrator_stops_without_waiting_out_its_reads(
    processes: Processes, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    proc = processes.start("orchestrator", "--block-ms", str(LONG_BLOCK_MS))
    wait_key(client, processes.settings.names.orchestrator_heartbeat())
    wait_until(lambda: client.info("clients")["blocked_clients"] == READERS, 30)  # reads begun
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(30)
    elapsed_s = time.monotonic() - started
    assert code == 0, processes.logs()
    assert elapsed_s < STOP_BOUND_S, f"stopped after {elapsed_s:.2f} s\n{processes.logs()}"


async def test_a_request_whose_read_was_cut_short_is_served_after_a_restart(
    processes: Processes, redis_url: str
) -> None:
    s = processes.settings
    names = s.names
    sync = redis.Redis.from_url(redis_url)
    service = OrchestratorService(load_pipeline(SEED), s)
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    await asyncio.wait_for(service.ready.wait(), 60)
    # Its only blocked clients (no worker runs yet): the requests, the stages' outputs, the
    # control stream and the released slots.
    await wait_for(lambda: sync.info("clients")["blocked_clients"] == READERS, 30)
    assert service.requests.reading

    # With the event loop held (sync calls), the request reaches the blocked read: the
    # server delivers it to the orchestrator's consumer, then the stop comes first.
    request = RequestMsg(request_id="cut-short", client_id="c1", prompt="one two")
    sync.xadd(names.requests, xadd_fields(entry_fields(request)))
    pending = sync.xpending(names.requests, keys.ORCHESTRATOR_GROUP)
    assert pending["pending"] == 1, pending  # delivered to the read in progress
    started = time.monotonic()
    stop.set()
    await asyncio.wait_for(running, STOP_BOUND_S)
    assert time.monotonic() - started < STOP_BOUND_S
    pending = sync.xpending(names.requests, keys.ORCHESTRATOR_GROUP)
    assert pending["pending"] == 1, pending  # neither handled nor acknowledged
    assert sync.xlen(names.client_out("c1")) == 0

    for stage in range(3):
        processes.start("worker", "--stage", str(stage))
    processes.start("orchestrator")  # the restart: reads its backlog first
    outputs: list[OrchOutputMsg] = []
    last = "0-0"
    end = time.monotonic() + 60
    while not (outputs and outputs[-1].finished):
        assert time.monotonic() < end, f"not served: {outputs}\n{processes.logs()}"
        reply = sync.xread({names.client_out("c1"): last}, block=200)
        for _stream, entries in stream_reply(reply):
            for entry_id, fields in entries:
                last = entry_id.decode()
                outputs.extend(parse_entries(fields, OrchOutputMsg, s.max_message_bytes))
    assert [o.request_id for o in outputs] == ["cut-short"] * len(outputs)
    assert all(o.error is None for o in outputs), outputs
    by_stage = {k: [o.data for o in outputs if o.stage_id == k] for k in (0, 2)}
    assert by_stage == {0: ["one", "two"], 2: ["wav:ONE", "wav:TWO"]}, outputs
    assert sync.xpending(names.requests, keys.ORCHESTRATOR_GROUP)["pending"] == 0


SIGNAL_EVERY_S = 0.001


def test_stop_signals_that_come_while_an_orchestrator_leaves_do_not_kill_it(
    processes: Processes, redis_url: str
) -> None:
    """`run` and `serve` send a stopping child SIGTERM and SIGINT on top of the terminal's
    SIGINT: however late they come, the orchestrator still leaves as it stopped, cleanly
    (killed by one, or a KeyboardInterrupt's traceback, once counted as a crash)."""
    client = redis.Redis.from_url(redis_url)
    proc = processes.start("orchestrator")
    wait_key(client, processes.settings.names.orchestrator_heartbeat())
    proc.send_signal(signal.SIGINT)
    sent = 1
    end = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < end:
        proc.send_signal(signal.SIGTERM if sent % 2 else signal.SIGINT)
        sent += 1
        time.sleep(SIGNAL_EVERY_S)  # the fault's pace: a flood would only starve its loop
    assert proc.poll() == 0, f"exit {proc.returncode} after {sent} signals\n{processes.logs()}"
    assert "Traceback" not in processes.logs()
