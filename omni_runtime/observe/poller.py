"""Metrics that come from Redis, and a process's metrics published to Redis.

`StreamStatsPoller` runs in the orchestrator: every few seconds it sets the
stream gauges (length, pending entries, oldest pending age) and the live
workers per stage from what Redis holds, and publishes a small summary of the
process's own metrics to `<ns>:stats:<role>` for `omni-runtime status`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterable
from typing import Any

import redis
from redis.exceptions import RedisError

from omni_runtime import keys
from omni_runtime.observe.metrics import HISTOGRAMS, Metrics
from omni_runtime.observe.redis_stats import (
    GroupInfo,
    StreamInfo,
    _id_ms,
    _s,
    read_heartbeats,
    server_now,
    stream_names,
)
from omni_runtime.observe.scaling import fill_stage_gauges, stage_load

log = logging.getLogger(__name__)

_STAGE_STREAM = re.compile(r":stage:(\d+):(in|out)$")


def stats_document(metrics: Metrics) -> dict[str, Any]:
    """A process's metrics, summarised small enough to publish every few seconds."""
    latency: dict[str, dict[str, float | None]] = {}
    for name in HISTOGRAMS:
        h = metrics.histogram(name)
        if h.count:
            latency[name] = {
                "count": h.count,
                **{f"p{int(q * 100)}": h.quantile(q) for q in (0.5, 0.9, 0.99)},
            }
    counters = {name: sum(series.values()) for name, series in metrics.snapshot().items()}
    return {"t": time.time(), "counters": counters, "latency": latency}


def publish_stats(client: redis.Redis, names: keys.Names, role: str, metrics: Metrics) -> None:
    client.set(names.stats(role), json.dumps(stats_document(metrics)), ex=keys.STATS_TTL_S)


def read_streams(client: redis.Redis, streams: list[str], now_ms: int) -> list[StreamInfo]:
    """What `redis_stats.read_stream` reads, for every stream in one pipeline (and one
    more for the groups with entries pending): a poll costs a few round trips, not
    three per stream. A stream gone meanwhile is left out."""
    with client.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xinfo_stream(stream)
            pipe.xinfo_groups(stream)
        replies = pipe.execute(raise_on_error=False)
    found: list[StreamInfo] = []
    for stream, info, group_list in zip(streams, replies[::2], replies[1::2], strict=True):
        if isinstance(info, Exception) or isinstance(group_list, Exception):
            continue
        last = info.get("last-generated-id")
        age = (now_ms - _id_ms(last)) / 1000 if last and _s(last) != "0-0" else None
        out = StreamInfo(stream, int(info.get("length", 0)), age)
        for g in group_list:
            lag = g.get("lag")
            pending, consumers = int(g.get("pending", 0)), int(g.get("consumers", 0))
            out.groups.append(
                GroupInfo(
                    _s(g["name"]), consumers, pending, None, None if lag is None else int(lag)
                )
            )
        found.append(out)
    waiting = [(s, g) for s in found for g in s.groups if g.pending]
    if waiting:
        with client.pipeline(transaction=False) as pipe:
            for s, g in waiting:
                pipe.xpending(s.name, g.name)
            summaries = pipe.execute(raise_on_error=False)
        for (_stream, g), summary in zip(waiting, summaries, strict=True):
            low = None if isinstance(summary, Exception) else summary.get("min")
            g.oldest_pending_age_s = (now_ms - _id_ms(low)) / 1000 if low else None
    return found


def fill_stream_gauges(metrics: Metrics, streams: Iterable[StreamInfo]) -> None:
    """Set the stream gauges to what was read, forgetting streams that went away."""
    seen_len, seen_group = [], []
    for s in streams:
        key = (("stream", s.name),)
        seen_len.append(key)
        metrics.set_gauge("omni_stream_length", s.length, stream=s.name)
        for g in s.groups:
            seen_group.append((("group", g.name), *key))
            metrics.set_gauge("omni_stream_pending_entries", g.pending, stream=s.name, group=g.name)
            age = g.oldest_pending_age_s or 0.0
            metrics.set_gauge(
                "omni_stream_oldest_pending_seconds", age, stream=s.name, group=g.name
            )
    metrics.remove_gauges("omni_stream_length", seen_len)
    metrics.remove_gauges("omni_stream_pending_entries", seen_group)
    metrics.remove_gauges("omni_stream_oldest_pending_seconds", seen_group)


class StreamStatsPoller:
    """A daemon thread: every `interval_s`, stream gauges into `metrics` and a stats key.

    Run one in the orchestrator (`role="orchestrator"`); workers may run one with
    `streams=False` to publish their own stats only.
    """

    def __init__(
        self,
        client: redis.Redis,
        names: keys.Names,
        metrics: Metrics,
        role: str,
        interval_s: float = 5.0,
        streams: bool = True,
        *,
        default_concurrency: int,
        target: int | None = None,
    ) -> None:
        self.client, self.names, self.metrics, self.role = client, names, metrics, role
        self.interval_s, self.streams = interval_s, streams
        self.default_concurrency = default_concurrency
        """A worker's slots when its heartbeat does not say (`OMNI_WORKER_MAX_CONCURRENCY`)."""
        self.target = target
        """`OMNI_SCALE_TARGET_PER_REPLICA`: the replicas wanted for the work waiting."""
        self._stages: set[int] = set()  # a stage whose last worker died still shows 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-stats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop polling and delete the stats key, as a clean exit deletes its heartbeat."""
        self._stop.set()
        self._thread.join(5)
        try:
            self.client.delete(self.names.stats(self.role))
        except RedisError as e:
            log.warning("deleting the stats key failed: %r", e)

    def poll_once(self) -> None:
        if self.streams:
            _, now_ms = server_now(self.client)
            streams = read_streams(self.client, stream_names(self.client, self.names), now_ms)
            fill_stream_gauges(self.metrics, streams)
            procs = read_heartbeats(self.client, self.names, time.time())
            stages = self._stages | {p.stage for p in procs if p.stage is not None}
            stages |= {int(m.group(1)) for s in streams if (m := _STAGE_STREAM.search(s.name))}
            by_name = {s.name: s for s in streams}
            loads = []
            for sid in stages:
                workers = [p for p in procs if p.kind == "worker" and p.stage == sid]
                self.metrics.set_gauge("omni_workers_alive", len(workers), stage=sid)
                stream = by_name.get(self.names.stage_in(sid))
                loads.append(
                    stage_load(sid, stream, workers, self.default_concurrency, self.target)
                )
            fill_stage_gauges(self.metrics, loads)
            self._stages = stages
        publish_stats(self.client, self.names, self.role, self.metrics)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except RedisError as e:
                log.warning("reading stream stats failed: %r", e)
            self._stop.wait(self.interval_s)
