"""`omni-runtime status`: what a running deployment is doing, read from Redis alone.

Live (refreshed every `--interval` seconds) with rich; `--once` prints one
snapshot, `--json` one machine-readable snapshot. Nothing here needs the
pipeline file: stages are found from their streams and heartbeats.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

import redis
from redis.exceptions import RedisError
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from omni_runtime import keys
from omni_runtime.observe import redis_stats
from omni_runtime.ops.flags import add_status_arguments as add_status_arguments
from omni_runtime.redis_io.clients import probe, sync_client
from omni_runtime.settings import Settings


def connect(settings: Settings) -> redis.Redis:
    """A sync client with bounded timeouts: a status tool never hangs on a dead Redis.
    A cluster client when the server is a cluster node (its SCANs visit every primary)."""
    url = settings.require_redis_url()
    cluster = probe(url, settings.redis_cluster)
    return sync_client(url, cluster=cluster, socket_connect_timeout=5, socket_timeout=10)


def collect_status(
    client: redis.Redis, names: keys.Names, look_around: bool = True
) -> dict[str, Any]:
    """One snapshot, as plain JSON-able data (what `--json` prints). `look_around`: if
    nothing runs in the namespace, name the ones that do (a SCAN of the whole keyspace,
    which the live view makes once, not at every refresh)."""
    now_s, now_ms = redis_stats.server_now(client)
    procs = redis_stats.read_heartbeats(client, names, now_s)
    streams = [
        redis_stats.read_stream(client, s, now_ms) for s in redis_stats.stream_names(client, names)
    ]
    found = [s for s in streams if s is not None]
    stages = sorted(
        {int(m.group(1)) for s in found if (m := re.search(r":stage:(\d+):(in|out)$", s.name))}
        | {p.stage for p in procs if p.stage is not None}
    )
    workers = {
        sid: sum(1 for p in procs if p.kind == "worker" and p.stage == sid) for sid in stages
    }
    dead = next((s.length for s in found if s.name == names.dead_letters), 0)
    try:
        leases: list[redis_stats.SlotLease] | None = redis_stats.read_slot_leases(client, names)
    except RedisError:  # an ACL without these keys: the shared heartbeat alone
        leases = None
    # each orchestrator process beats a key of its own beside the one they share, which
    # names the pipeline (one from before that beats the shared key alone still counts)
    own = sum(1 for p in procs if p.kind == "orchestrator" and p.name)
    shared = next((p for p in procs if p.kind == "orchestrator" and not p.name), None)
    beating = own or int(shared is not None)
    return {
        "namespace": names.namespace,
        "time": now_s,
        "pipeline": None if shared is None else {"name": shared.value, "mode": shared.mode},
        "orchestrators": beating if not leases else len({lease.holder for lease in leases}),
        "orchestrator_slots": None if leases is None else redis_stats.as_jsonable(leases),
        "workers_per_stage": {str(k): v for k, v in workers.items()},
        "processes": redis_stats.as_jsonable(procs),
        "streams": redis_stats.as_jsonable(found),
        "dead_letters": dead,
        "request_rate_per_s": redis_stats.request_rate(client, names, now_ms),
        "stats": redis_stats.read_stats(client, names),
        "redis_memory": redis_memory(client),
        "other_namespaces": other_namespaces(client, names) if look_around and not procs else [],
    }


def redis_memory(client: redis.Redis) -> dict[str, Any] | None:
    """Redis's memory against its `maxmemory`, and the writes it refused for memory so far
    (`INFO memory`, `INFO errorstats`; on a cluster, the fullest node). `out_of_memory`:
    at maxmemory with nothing it may evict, so it refuses writes. None if INFO is denied."""
    try:
        nodes = _per_node(client.info("memory"))
        refused = sum(
            int(stats.get("errorstat_OOM", {}).get("count", 0))
            for stats in _per_node(client.info("errorstats"))
        )
    except RedisError:  # an ACL without INFO: nothing to say
        return None
    used, limit, policy = max(
        (int(n.get("used_memory", 0)), int(n.get("maxmemory", 0)), str(n.get("maxmemory_policy")))
        for n in nodes
    )
    full = limit > 0 and used >= limit and policy == "noeviction"
    return {
        "used_bytes": used,
        "maxmemory_bytes": limit,
        "policy": policy,
        "out_of_memory": full,
        "oom_refusals": refused,
    }


def _per_node(info: Any) -> list[dict[str, Any]]:
    """A cluster client's INFO maps each node to its reply; a server's is the reply."""
    if not isinstance(info, dict):
        return []
    ours = any(k.startswith(("used_memory", "errorstat_")) for k in info)
    if info and not ours and all(isinstance(v, dict) for v in info.values()):
        return list(info.values())
    return [info]


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _opt(value: Any) -> str:
    return "-" if value is None else str(value)


def _pipeline_label(pipeline: dict[str, Any] | None) -> str:
    if not pipeline:
        return ""
    return f"  pipeline {pipeline['name']}" + (f" ({pipeline['mode']})" if pipeline["mode"] else "")


def other_namespaces(client: redis.Redis, names: keys.Names) -> list[str]:
    """The namespaces with an orchestrator on this Redis, this one aside: what `status` of
    an empty namespace suggests (`serve` runs several pipelines each in `<ns>.<name>`)."""
    suffix = names.orchestrator_heartbeat().removeprefix(names.prefix)
    beats = redis_stats.scan_keys(client, f"*:{suffix}", "string")
    return sorted({k.removesuffix(":" + suffix) for k in beats} - {names.namespace})


def _processes_table(snap: dict[str, Any]) -> Table:
    t = Table(title="processes", title_justify="left", expand=False)
    cols = ("kind", "stage", "name", "host", "pid", "up", "last beat", "in flight", "done")
    for col in (*cols, "engine"):
        t.add_column(col, justify="right" if col in ("pid", "in flight", "done") else "left")
    own_rows = any(p["kind"] == "orchestrator" and p["name"] for p in snap["processes"])
    for p in snap["processes"]:
        if p["kind"] == "client" or (own_rows and p["kind"] == "orchestrator" and not p["name"]):
            continue  # the shared orchestrator heartbeat: in the header, as the pipeline
        t.add_row(
            p["kind"],
            _opt(p["stage"]),
            _short(p["name"] or p["value"] or ""),
            _opt(p["host"]),
            _opt(p["pid"]),
            _age(p["uptime_s"]),
            _age(p["last_beat_s"]),
            _opt(p["in_flight"]),
            _opt(p["completed"]),
            _engine(p.get("engine")),
        )
    return t


def _slots_table(leases: list[dict[str, Any]]) -> Table:
    """One row per slot held: which orchestrator process (its token) and how long its
    lease has left; a slot taken over shows its new holder."""
    t = Table(title="orchestrator slots", title_justify="left")
    for col in ("slot", "orchestrator", "lease left"):
        t.add_column(col, justify="right" if col == "slot" else "left")
    for lease in leases:
        t.add_row(str(lease["slot"]), _short(lease["holder"]), _age(lease["ttl_s"]))
    return t


def _engine(stats: dict[str, Any] | None) -> str:
    """An async engine's batch: `running+waiting/capacity`, e.g. `4+2/4`."""
    if not stats:
        return "-"
    if "error" in stats:
        return f"stats failed: {stats['error']}"
    return f"{stats.get('running')}+{stats.get('waiting')}/{stats.get('capacity')}"


def _streams_table(snap: dict[str, Any]) -> Table:
    t = Table(title="streams", title_justify="left")
    for col in (
        "stream",
        "length",
        "last entry",
        "group",
        "consumers",
        "pending",
        "oldest pending",
        "lag",
    ):
        t.add_column(col, justify="left" if col in ("stream", "group") else "right")
    for s in snap["streams"]:
        name = s["name"].removeprefix(snap["namespace"] + ":")
        groups = s["groups"] or [None]
        for i, g in enumerate(groups):
            head = (name, str(s["length"]), _age(s["last_entry_age_s"])) if i == 0 else ("", "", "")
            if g is None:
                t.add_row(*head, "", "", "", "", "")
                continue
            style = "red" if g["pending"] and (g["oldest_pending_age_s"] or 0) > 30 else None
            t.add_row(
                *head,
                g["name"],
                str(g["consumers"]),
                Text(str(g["pending"]), style=style or ""),
                _age(g["oldest_pending_age_s"]),
                _opt(g["lag"]),
            )
    return t


def _latency_table(snap: dict[str, Any]) -> Table | None:
    rows = [
        (role, name, lat)
        for role, doc in sorted(snap["stats"].items())
        for name, lat in sorted(doc.get("latency", {}).items())
    ]
    if not rows:
        return None
    t = Table(title="latency (since each process started)", title_justify="left")
    for col in ("process", "histogram", "count", "p50", "p90", "p99"):
        t.add_column(col, justify="left" if col in ("process", "histogram") else "right")
    for role, name, lat in rows:
        short = name.removeprefix("omni_").removesuffix("_seconds")
        t.add_row(
            role, short, str(lat.get("count")), *(_age(lat.get(q)) for q in ("p50", "p90", "p99"))
        )
    return t


def render(snap: dict[str, Any]) -> Group:
    """The rich renderable of one snapshot."""
    per_stage = snap["workers_per_stage"]
    missing = [k for k, n in per_stage.items() if n == 0]
    pipeline = snap.get("pipeline")
    head = Text.assemble(
        (f"namespace {snap['namespace']}", "bold"),
        _pipeline_label(pipeline),
        f"  orchestrators {snap['orchestrators']}",
        "  workers " + (", ".join(f"stage {k}: {n}" for k, n in per_stage.items()) or "none"),
        f"  requests/s {snap['request_rate_per_s']:.2f}",
        ("  dead letters " + str(snap["dead_letters"]), "red" if snap["dead_letters"] else ""),
    )
    parts: list[Any] = [head]
    memory = snap.get("redis_memory")
    if memory and memory["maxmemory_bytes"]:
        mb = 1024 * 1024
        line = (
            f"Redis memory {memory['used_bytes'] / mb:.1f} of {memory['maxmemory_bytes'] / mb:.1f} "
            f"MiB ({memory['policy']}); writes refused for memory so far: {memory['oom_refusals']}"
        )
        if memory["out_of_memory"]:
            parts.append(Text(f"Redis is out of memory: {line}", style="bold red"))
        else:
            parts.append(Text(line))
    if snap["orchestrators"] == 0:
        parts.append(Text("no orchestrator heartbeat", style="bold red"))
    if snap.get("other_namespaces"):
        found = ", ".join(snap["other_namespaces"])
        parts.append(Text(f"nothing runs in this namespace; on this Redis: {found} (--namespace)"))
    if missing:
        parts.append(Text(f"no live worker for stage {', '.join(missing)}", style="bold red"))
    parts += [_processes_table(snap)]
    if snap.get("orchestrator_slots"):
        parts.append(_slots_table(snap["orchestrator_slots"]))
    parts.append(_streams_table(snap))
    latency = _latency_table(snap)
    if latency is not None:
        parts.append(latency)
    return Group(*parts)


def run_status(
    args: argparse.Namespace,
    settings: Settings,
    client: redis.Redis | None = None,
    console: Console | None = None,
) -> int:
    """The `status` subcommand; 0 when an orchestrator and a worker of every stage are alive
    and Redis is not out of memory."""
    client = client if client is not None else connect(settings)
    if console is None:  # piped: wide enough that no column is cut
        console = Console(width=None if sys.stdout.isatty() else 160)
    names = settings.names
    if args.json or args.once:
        snap = collect_status(client, names)
        if args.json:
            console.file.write(json.dumps(snap, indent=1) + "\n")
        else:
            console.print(render(snap))
        memory = snap["redis_memory"]
        healthy = (
            snap["orchestrators"] > 0
            and all(snap["workers_per_stage"].values())
            and not (memory and memory["out_of_memory"])
        )
        return 0 if healthy else 1
    good: Any = Text("reading Redis ...")
    first = True
    with Live(good, console=console, auto_refresh=False) as live:
        try:
            while True:
                try:  # while Redis is unreachable, say so over the last good frame
                    good = render(collect_status(client, names, look_around=first))
                    first = False
                    live.update(good, refresh=True)
                except RedisError as e:
                    live.update(Group(Text(f"Redis: {e} (retrying)", style="bold red"), good))
                    live.refresh()
                time.sleep(max(0.1, args.interval))
        except KeyboardInterrupt:
            return 0


def _short(name: str) -> str:
    """An orchestrator's random token cut to 12 characters; a given name (`serve`'s, a
    pod's: `--orchestrator-id`) whole."""
    return name[:12] if re.fullmatch(r"[0-9a-f]{32}", name) else name
