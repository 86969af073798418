"""The autoscaling signal, per stage, from what the orchestrator's stats poller reads anyway.

* **backlog**: inputs no replica has taken yet — the `workers` group's lag on the stage's
  input stream, which is what KEDA's `redis-streams` scaler reads in `lagCount` mode.
  Redis counts the lag from the stream's add counter, so once `MAXLEN` trimmed away
  entries nobody had read, the lag still counts them until the group catches up (Redis
  7.0 measured: 10 entries added to a caught-up group, trimmed to 3, lag 10). Workers
  delete each input they acknowledge, so an input stream holds exactly the inputs in
  flight and those waiting: `length - pending` is the true backlog whenever the two
  differ, and stands in when Redis cannot tell the lag (NULL).
* **in flight**: inputs read and not acknowledged (the group's pending entries).
* **capacity**: live replicas times each one's `OMNI_WORKER_MAX_CONCURRENCY` (from their
  heartbeats).
* **desired replicas**: `ceil((backlog + in flight) / target)`, target =
  `OMNI_SCALE_TARGET_PER_REPLICA` or the replicas' max concurrency: a hint an autoscaler
  can follow with a target of 1 per replica (`docs/deploy.md`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.observe.redis_stats import ProcessInfo, StreamInfo

GAUGE_NAMES = (
    "omni_stage_backlog_entries",
    "omni_stage_in_flight",
    "omni_stage_capacity",
    "omni_stage_desired_replicas",
)


@dataclass(frozen=True)
class StageLoad:
    stage: int
    backlog: int
    in_flight: int
    replicas: int
    capacity: int
    desired_replicas: int


def backlog_of(length: int, pending: int, lag: int | None) -> int:
    """The group's backlog: its lag, bounded by what the stream still holds (see above)."""
    held = max(0, length - pending)
    return held if lag is None else min(lag, held)


def stage_load(
    stage: int,
    stream: StreamInfo | None,
    workers: list[ProcessInfo],
    default_concurrency: int,
    target: int | None,
) -> StageLoad:
    group = (
        None
        if stream is None
        else next((g for g in stream.groups if g.name == keys.WORKERS_GROUP), None)
    )
    if stream is None:
        backlog = in_flight = 0
    elif group is None:  # no worker ever started: everything in the stream waits
        backlog, in_flight = stream.length, 0
    else:
        backlog, in_flight = backlog_of(stream.length, group.pending, group.lag), group.pending
    per_replica = [w.max_concurrency or default_concurrency for w in workers]
    capacity = sum(per_replica)
    if target is None:
        target = max(per_replica) if per_replica else default_concurrency
    desired = math.ceil((backlog + in_flight) / target)
    return StageLoad(stage, backlog, in_flight, len(workers), capacity, desired)


def fill_stage_gauges(metrics: Metrics, loads: Iterable[StageLoad]) -> None:
    for load in loads:
        sid = load.stage
        metrics.set_gauge("omni_stage_backlog_entries", load.backlog, stage=sid)
        metrics.set_gauge("omni_stage_in_flight", load.in_flight, stage=sid)
        metrics.set_gauge("omni_stage_capacity", load.capacity, stage=sid)
        metrics.set_gauge("omni_stage_desired_replicas", load.desired_replicas, stage=sid)
