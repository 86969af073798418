"""What a worker shows of itself: its heartbeat document, its per-stage timings, its exports.

Called by the loop's pass only, one thread at a time (the timer's bookkeeping is not shared
with the I/O threads); `start` and `close` bracket the worker's run.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised
from omni_runtime.observe.probes import Probes
from omni_runtime.observe.start import Observability, ObserveSettings
from omni_runtime.observe.timings import StageTimer
from omni_runtime.stage_api import EngineStats
from omni_runtime.worker.actions import Actions, Input


class WorkerObservation:
    def __init__(
        self,
        obs: Observability,
        stage_id: int,
        worker_id: str,
        in_stream: str,
        settings: ObserveSettings,
        max_concurrency: int | None = None,
    ) -> None:
        self.obs = obs
        self.settings = settings
        """What `start` starts: the metrics endpoint, tracers and stats poller."""
        self.metrics = obs.metrics
        self.max_concurrency = max_concurrency
        self.stage_id = stage_id
        self.worker_id = worker_id
        self.in_stream = in_stream
        self.started_at = time.time()
        self.timer = StageTimer(obs.metrics, stage_id)
        self._engine_stats: Callable[[], EngineStats] | None = None

    def watch_engine(self, stats: Callable[[], EngineStats]) -> None:
        """An engine that counts its own requests (an async engine): its running, waiting
        and capacity go into the heartbeat (`status`) and the gauges `omni_engine_*`."""
        self._engine_stats = stats
        for field in ("running", "waiting", "capacity"):

            def read(field: str = field) -> float:
                return float(getattr(stats(), field))

            self.metrics.gauge_callback(f"omni_engine_{field}", read, stage=self.stage_id)

    def start(self, redis_client: Callable[[], Any], probes: Probes | None = None) -> None:
        """The metrics endpoint (with `probes`), tracers and stats poller `settings` ask for."""
        role = f"stage:{self.stage_id}:{self.worker_id}"
        labels = {"stage": str(self.stage_id)}
        self.obs.start(self.settings, role, redis_client, const_labels=labels, probes=probes)

    def close(self) -> None:
        self.obs.close()

    def inputs(self, inputs: list[Input]) -> None:
        for inp in inputs:
            if inp.refused is None:
                self.timer.read(inp.msg.request_id, inp.entry_id)

    def aborted(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.timer.done(rid)

    def published(self, actions: Actions) -> None:
        for out in actions.outputs:
            self.timer.output("error" if out.is_error else None)
            if out.ends:
                self.timer.done(out.request_id)

    def count(self, name: str, **labels: object) -> int:
        return int(self.metrics.value(name, **labels))

    def status(self, in_flight: int) -> dict[str, Any]:
        """The heartbeat's value: who this worker is and what it has done."""
        return {
            "worker_id": self.worker_id,
            "stage_id": self.stage_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "in_flight": in_flight,
            "max_concurrency": self.max_concurrency,
            "completed": self.count("omni_requests_completed_total"),
            "failed": self.count("omni_requests_failed_total"),
            "aborted": self.count("omni_aborts_total"),
            "malformed_inputs": self.count("omni_malformed_entries_total", stream=self.in_stream),
            "takeovers": self.count("omni_takeovers_total"),
            "deposed": self.count("omni_deposed_requests_total"),
            "engine_resets": self.count("omni_engine_resets_total"),
            "poisoned": self.count("omni_poison_requests_total"),
        } | self._engine_status()

    def _engine_status(self) -> dict[str, Any]:
        if self._engine_stats is None:
            return {}
        stats = foreign.call(self._engine_stats)  # the engine's: must not stop the heartbeat
        if isinstance(stats, Raised):
            return {"engine": {"error": stats.describe()}}
        return {"engine": asdict(stats)}
