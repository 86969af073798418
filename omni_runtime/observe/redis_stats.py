"""What a deployment looks like from Redis: live processes, streams, request rate, latencies.

Read by `omni-runtime status` and by `StreamStatsPoller`, which turns stream
lengths and pending entries into gauges of the orchestrator's `Metrics`. Every
read is bounded (SCAN counts, XREVRANGE counts, value sizes). Times come from
Redis' TIME, so a status host with a skewed clock still shows true ages.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import redis
from redis.exceptions import ResponseError

from omni_runtime import keys

log = logging.getLogger(__name__)

MAX_SCAN_KEYS = 10_000
"""Discovery stops after this many keys per pattern: a status call never walks a huge keyspace."""
MAX_VALUE_BYTES = 64 * 1024
RATE_SAMPLE = 1000
"""Request entries looked at to estimate the request rate."""


def _s(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def scan_keys(client: redis.Redis, pattern: str, type_: str | None = None) -> list[str]:
    """Keys matching `pattern`: the one place that discovers keys by SCAN.

    On a Redis Cluster the client is redis-py's cluster client, whose `scan_iter`
    walks every primary (a key lives on the shard of its slot, not on the node the
    URL names); a registry set per namespace would avoid SCAN if it ever got too slow.
    """
    found: list[str] = []
    for key in client.scan_iter(match=pattern, count=1000, _type=type_):
        found.append(_s(key))
        if len(found) >= MAX_SCAN_KEYS:
            log.warning("more than %d keys match %s; showing the first", MAX_SCAN_KEYS, pattern)
            break
    return sorted(found)


def heartbeat_value(
    in_flight: int | None = None, completed: int | None = None, **extra: Any
) -> str:
    """The JSON document a process may beat with (today's plain strings are read too)."""
    doc = {"host": socket.gethostname(), "pid": os.getpid(), "started_at": _STARTED_AT}
    doc.update({"in_flight": in_flight, "completed": completed, **extra})
    return json.dumps({k: v for k, v in doc.items() if v is not None})


_STARTED_AT = time.time()


def parse_heartbeat(raw: bytes | None) -> dict[str, Any]:
    """A heartbeat's value as a dict: a JSON or msgpack document, else `{"value": text}`."""
    if raw is None:
        return {}
    raw = raw[:MAX_VALUE_BYTES]
    if raw[:1] == b"{":
        try:
            doc = json.loads(raw)
            if isinstance(doc, dict):
                return doc
        except ValueError:
            pass
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=False, max_bin_len=MAX_VALUE_BYTES)
        if isinstance(doc, dict):
            return {str(k): v for k, v in doc.items()}
    except (ValueError, TypeError):  # not msgpack (msgpack's errors are ValueErrors, an
        pass  # unhashable key a TypeError): a plain string such as today's worker id
    return {"value": _s(raw)}


@dataclass
class ProcessInfo:
    kind: str  # orchestrator, worker or client
    key: str
    stage: int | None = None
    name: str | None = None
    host: str | None = None
    pid: int | None = None
    uptime_s: float | None = None
    last_beat_s: float | None = None
    in_flight: int | None = None
    completed: int | None = None
    value: str | None = None
    engine: dict[str, Any] | None = None
    """An async engine's `running`, `waiting` and `capacity` (its worker's heartbeat)."""
    max_concurrency: int | None = None
    """A worker's `OMNI_WORKER_MAX_CONCURRENCY`: what it may hold at once."""
    mode: str | None = None
    """The shared orchestrator heartbeat's: the pipeline's mode (its name is `value`)."""


def _process(key: str, prefix: str, doc: dict[str, Any], ttl_ms: int, now_s: float) -> ProcessInfo:
    role = key[len(prefix) :].split(":")
    info = ProcessInfo(kind="orchestrator" if role[0] == "orchestrator" else role[0], key=key)
    if role[0] == "stage" and len(role) >= 3:
        info.kind, info.name = "worker", ":".join(role[2:])
        info.stage = int(role[1]) if role[1].isdigit() else None
    elif role[0] in ("client", "orchestrator"):  # an orchestrator process's own: its token
        info.name = ":".join(role[1:]) or None
    info.host = doc.get("host")
    info.pid = doc.get("pid")
    started = doc.get("started_at")
    info.uptime_s = now_s - float(started) if isinstance(started, int | float) else None
    info.last_beat_s = keys.HEARTBEAT_TTL_S - ttl_ms / 1000 if ttl_ms >= 0 else None
    info.in_flight = doc.get("in_flight")
    info.completed = doc.get("completed")
    info.value = doc.get("value", doc.get("pipeline"))  # an orchestrator names its pipeline
    info.mode = doc.get("mode") if isinstance(doc.get("mode"), str) else None
    limit = doc.get("max_concurrency")
    info.max_concurrency = limit if isinstance(limit, int) else None
    engine = doc.get("engine")
    info.engine = engine if isinstance(engine, dict) else None
    return info


def read_heartbeats(client: redis.Redis, names: keys.Names, now_s: float) -> list[ProcessInfo]:
    """Every live process of the namespace, from its heartbeat key (the Redis state's
    epoch token, kept beside them, is none)."""
    prefix = names.heartbeat("")
    hb_keys = [k for k in scan_keys(client, f"{prefix}*", "string") if k != names.epoch]
    with client.pipeline(transaction=False) as pipe:
        for key in hb_keys:
            pipe.get(key)
            pipe.pttl(key)
        replies = pipe.execute()
    out = []
    for i, key in enumerate(hb_keys):
        raw, ttl_ms = replies[2 * i], replies[2 * i + 1]
        if raw is not None:
            out.append(_process(key, prefix, parse_heartbeat(raw), int(ttl_ms), now_s))
    return out


@dataclass
class SlotLease:
    slot: int
    holder: str
    """The token of the orchestrator process holding the slot's lease."""
    ttl_s: float | None


def read_slot_leases(client: redis.Redis, names: keys.Names) -> list[SlotLease]:
    """The orchestrator slots whose lease is held now: every orchestrator process holds
    its own slot's (the one heartbeat key they share cannot count them)."""
    slots = sorted(int(s) for s in map(_s, client.hkeys(names.orchestrator_slots)) if s.isdigit())
    with client.pipeline(transaction=False) as pipe:
        for slot in slots:
            pipe.get(names.orchestrator_lease(slot))
            pipe.pttl(names.orchestrator_lease(slot))
        replies = pipe.execute()
    held = []
    for i, slot in enumerate(slots):
        token, ttl_ms = replies[2 * i], replies[2 * i + 1]
        if token is not None:
            held.append(SlotLease(slot, _s(token), int(ttl_ms) / 1000 if ttl_ms >= 0 else None))
    return held


@dataclass
class GroupInfo:
    name: str
    consumers: int
    pending: int
    oldest_pending_age_s: float | None
    lag: int | None


@dataclass
class StreamInfo:
    name: str
    length: int
    last_entry_age_s: float | None
    groups: list[GroupInfo] = field(default_factory=list)


def _id_ms(entry_id: Any) -> int:
    return int(_s(entry_id).split("-", 1)[0])


def stream_names(client: redis.Redis, names: keys.Names) -> list[str]:
    """The namespace's fixed streams, then every stage and client stream that exists."""
    fixed = [names.requests, names.control, names.dead_letters]
    stages = scan_keys(client, names.stage_stream_pattern(), "stream")
    clients = scan_keys(client, f"{names.client_out('')}*", "stream")
    return fixed + [s for s in stages if s.endswith((":in", ":out"))] + clients


def read_stream(client: redis.Redis, stream: str, now_ms: int) -> StreamInfo | None:
    """Length, last entry's age, and per group its pending count and oldest pending entry."""
    try:
        info: Any = client.xinfo_stream(stream)
    except ResponseError:  # no such key
        return None
    last = info.get("last-generated-id")
    out = StreamInfo(
        stream,
        int(info.get("length", 0)),
        (now_ms - _id_ms(last)) / 1000 if last and _s(last) != "0-0" else None,
    )
    groups: Any = client.xinfo_groups(stream)
    for g in groups:
        gname = _s(g["name"])
        pending = int(g.get("pending", 0))
        oldest = None
        if pending:
            summary: Any = client.xpending(stream, gname)
            low = summary.get("min")
            oldest = (now_ms - _id_ms(low)) / 1000 if low else None
        lag = g.get("lag")
        out.groups.append(
            GroupInfo(
                gname,
                int(g.get("consumers", 0)),
                pending,
                oldest,
                None if lag is None else int(lag),
            )
        )
    return out


def request_rate(
    client: redis.Redis, names: keys.Names, now_ms: int, window_s: float = 60.0
) -> float:
    """Requests per second over the last `window_s`, from the requests stream's entry ids."""
    entries: Any = client.xrevrange(names.requests, "+", "-", count=RATE_SAMPLE)
    if not entries:
        return 0.0
    stamps = [_id_ms(eid) for eid, _ in entries]
    recent = [t for t in stamps if t >= now_ms - window_s * 1000]
    if len(recent) == len(stamps) == RATE_SAMPLE:  # the sample is denser than the window
        return len(recent) / max((now_ms - recent[-1]) / 1000, 1e-3)
    return len(recent) / window_s


def server_now(client: redis.Redis) -> tuple[float, int]:
    """Redis' clock as (seconds, milliseconds)."""
    sec, usec = client.time()
    return sec + usec / 1e6, sec * 1000 + usec // 1000


def read_stats(client: redis.Redis, names: keys.Names) -> dict[str, Any]:
    """Every published stats document, by role."""
    prefix = names.stats("")
    found = scan_keys(client, f"{prefix}*", "string")
    with client.pipeline(transaction=False) as pipe:  # one GET each: the keys span slots
        for key in found:
            pipe.get(key)
        values = pipe.execute()
    out: dict[str, Any] = {}
    for key, raw in zip(found, values, strict=True):
        if raw is not None:
            try:
                out[key[len(prefix) :]] = json.loads(raw[:MAX_VALUE_BYTES])
            except ValueError:
                continue
    return out


def as_jsonable(items: Iterable[Any]) -> list[dict[str, Any]]:
    return [asdict(x) for x in items]
