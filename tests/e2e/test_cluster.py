"""Redis Cluster for real: `run` on any node's URL in both modes, discovery across shards,
and the three ways a deployment is unusable, each a one-line error without a traceback."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import redis.cluster

from omni_runtime import keys
from omni_runtime.errors import FatalError
from omni_runtime.local.launcher import RedisServer, free_port
from omni_runtime.local.redis_cluster import cluster_node_port
from omni_runtime.observe import redis_stats
from omni_runtime.ops.status import collect_status
from omni_runtime.orchestrator.leases import Leases
from omni_runtime.redis_io.clients import async_client, probe, redacted, sync_client
from omni_runtime.redis_io.liveness import stage_has_live_replica
from omni_runtime.worker.actions import stream_id
from omni_runtime.worker.fence import read_ownership
from tests.e2e.test_cli import SEED, SEED_OUTPUTS, cli, cli_env, describe, outputs

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_server]


def node_urls(cluster_url: str) -> list[str]:
    client: Any = sync_client(cluster_url, cluster=True)  # a RedisCluster
    try:
        return sorted(f"redis://{n.host}:{n.port}/0" for n in client.get_primaries())
    finally:
        client.close()


@pytest.mark.parametrize("mode", ["sequential", "streaming"])
def test_run_on_any_cluster_node_in_both_modes(redis_cluster_url: str, mode: str) -> None:
    """Not the node the fixture handed out: any node's URL reaches the whole cluster."""
    other = next(u for u in node_urls(redis_cluster_url) if u != redis_cluster_url)
    proc = cli("run", "--pipeline", SEED, "--mode", mode, "--redis-url", other, "hi there")
    assert proc.returncode == 0, describe(proc)
    assert f"pipeline 'seed' ({mode} mode) on configured" in proc.stdout
    got = outputs(proc.stdout)
    # Streaming interleaves the stages, and either final stage may end last: each stage's
    # data in order, and only the very last output says the request finished.
    by_stage = [(sid, data) for sid, data, _f in sorted(got, key=lambda out: out[0])]
    assert by_stage == [(sid, data) for sid, data, _f in SEED_OUTPUTS], describe(proc)
    assert [f for _s, _d, f in got] == [False] * (len(got) - 1) + [True], describe(proc)
    assert "Traceback" not in proc.stderr


def test_discovery_finds_processes_on_every_shard(redis_cluster_url: str) -> None:
    """Heartbeats and stats land on the shards of their slots; discovery sees them all."""
    names = keys.Names(f"d{uuid.uuid4().hex[:6]}")
    client = sync_client(redis_cluster_url, cluster=True)
    try:
        beats = [names.stage_heartbeat(sid, f"w{sid}") for sid in range(12)]
        for key in beats:
            client.set(key, redis_stats.heartbeat_value(in_flight=0), px=60_000)
            client.set(names.stats(key.rpartition(":hb:")[2]), "{}", ex=60)
        assert isinstance(client, redis.cluster.RedisCluster)
        shards = {client.get_node_from_key(key).name for key in beats}
        assert len(shards) == 3, "the heartbeats must spread over every shard for this test"
        procs = redis_stats.read_heartbeats(client, names, 0.0)
        assert sorted(p.stage for p in procs if p.stage is not None) == list(range(12))
        assert len(redis_stats.read_stats(client, names)) == 12
        snap = collect_status(client, names)  # what `omni-runtime status` shows
        assert snap["workers_per_stage"] == {str(sid): 1 for sid in range(12)}
    finally:
        client.close()

    async def live() -> list[bool]:
        aio = async_client(redis_cluster_url, cluster=True)
        try:
            return [await stage_has_live_replica(aio, names, sid) for sid in range(13)]
        finally:
            await aio.aclose()

    assert asyncio.run(live()) == [True] * 12 + [False]


# --- clear errors ------------------------------------------------------------------------


def one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("omni-runtime: error: "), describe(proc)
    for needle in needles:
        assert needle in lines[0], describe(proc)


@pytest.mark.parametrize("command", ["worker", "run"])
def test_an_unreachable_cluster_url_stops_with_one_line(command: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    args = ["--pipeline", SEED, "--redis-url", url, "--redis-cluster", "yes"]
    args += {"worker": ["--stage", "0"], "run": ["hi"]}.get(command, [])
    one_line_error(
        cli(command, *args, env=cli_env(OMNI_STARTUP_TIMEOUT_S="5")), "cannot be reached"
    )


@pytest.fixture
def half_a_cluster(tmp_path: Path) -> Iterator[str]:
    """A cluster node serving 8192 of the 16384 slots: `cluster_state:fail`."""
    conf = str(tmp_path / "nodes.conf")
    args = ("--cluster-enabled", "yes", "--dir", str(tmp_path), "--cluster-config-file", conf)
    with RedisServer(extra_args=args, pick_port=cluster_node_port) as server:
        client = redis.Redis.from_url(server.url)
        try:
            client.execute_command("CLUSTER ADDSLOTSRANGE", 0, 8191)
        finally:
            client.close()
        yield server.url


@pytest.mark.parametrize("command", ["orchestrator"])
def test_a_cluster_with_slots_uncovered_stops_with_one_line(
    half_a_cluster: str, command: str
) -> None:
    args = ["--pipeline", SEED, "--redis-url", half_a_cluster]
    args += ["--stage", "1"] if command == "worker" else []
    one_line_error(cli(command, *args), "cluster_state:fail", "8192 of 16384 slots")


@pytest.mark.parametrize("command", ["orchestrator", "worker"])
def test_a_namespace_the_acl_user_may_not_touch_stops_with_one_line(
    redis_url: str, command: str
) -> None:
    user, secret = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser(
        user, enabled=True, passwords=[f"+{secret}"], keys=["other:*"], commands=["+@all"]
    )
    try:
        url = redis_url.replace("redis://", f"redis://{user}:{secret}@")
        args = ["--pipeline", SEED, "--redis-url", url, "--namespace", "mine"]
        args += ["--stage", "0"] if command == "worker" else []
        proc = cli(command, *args)
        one_line_error(proc, f"Redis user {user!r} may not use namespace 'mine'")
        assert secret not in proc.stderr
    finally:
        admin.acl_deluser(user)
        admin.close()


def test_the_client_kind_comes_from_the_server_unless_forced(
    redis_url: str, redis_cluster_url: str
) -> None:
    assert probe(redis_cluster_url) is True and probe(redis_url) is False
    assert probe(redis_cluster_url, "no") is False  # forced: plain clients on a cluster node
    with pytest.raises(FatalError, match="is no cluster node"):
        probe(redis_url, "yes")
    assert redacted("redis://bob:secret@h:6379/0") == "redis://bob:***@h:6379/0"


def test_a_user_denied_info_still_starts_on_a_single_server(redis_url: str) -> None:
    """INFO and CLUSTER denied: `auto` cannot ask, takes a single server, and says nothing."""
    user, secret = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser(
        user,
        enabled=True,
        passwords=[f"+{secret}"],
        keys=["*"],
        commands=["+@all", "-info", "-cluster"],
    )
    try:
        url = redis_url.replace("redis://", f"redis://{user}:{secret}@")
        denied = redis.Redis.from_url(url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            denied.info("cluster")
        denied.close()
        assert probe(url) is False
    finally:
        admin.acl_deluser(user)
        admin.close()


def test_a_workers_ownership_check_reads_a_cluster(redis_cluster_url: str) -> None:
    """After a stall (a failover longer than 0.8 heartbeat TTL) a worker reads which inputs
    are still its own: a cluster client's transaction leaves those replies half parsed."""
    stream = f"{{fence}}:{uuid.uuid4().hex}"
    client = sync_client(redis_cluster_url, cluster=True)
    try:
        client.xgroup_create(stream, keys.WORKERS_GROUP, id="0", mkstream=True)
        mine, taken = (client.xadd(stream, {"p": r}) for r in ("mine", "taken"))
        client.xreadgroup(keys.WORKERS_GROUP, "A", {stream: ">"}, count=2)
        client.xclaim(stream, keys.WORKERS_GROUP, "B", min_idle_time=0, message_ids=[taken])
        own = read_ownership(client, stream, "A")
        assert (own.mine, own.others) == (frozenset({mine}), frozenset({taken}))
        assert own.last_delivered == stream_id(cast(bytes, taken))
    finally:
        client.close()


async def test_a_lapsed_lease_is_kept_on_a_cluster(redis_cluster_url: str) -> None:
    """A failover longer than the lease TTL: the lease lapsed, nobody took it, the holder
    sets it again (the careful round, a watched transaction, on a cluster client)."""
    names = keys.Names(f"t{uuid.uuid4().hex[:8]}")
    client = async_client(redis_cluster_url, cluster=True)
    try:
        leases = Leases(client, names, 5.0)
        slot = await leases.take_lowest_free()
        await client.delete(names.orchestrator_lease(slot))
        assert await leases.refresh() == {slot}
        assert await client.get(names.orchestrator_lease(slot)) == leases.token.encode()
    finally:
        await client.aclose()


async def test_connections_closed_under_commands_fail_them_as_connection_errors(
    redis_cluster_url: str,
) -> None:
    """redis-py closes every connection of its asyncio cluster client on CLUSTERDOWN, under
    other tasks' commands (here `aclose` does it); those must fail as ConnectionErrors,
    which the runtime's loops retry, never as the AttributeError redis-py raises."""
    client = async_client(redis_cluster_url, cluster=True)
    kinds: dict[type, int] = {}
    try:
        await client.initialize()
        for round_ in range(40):
            reads = [client.xread({f"k{i}": "0-0"}, block=100) for i in range(30)]
            tasks = [asyncio.ensure_future(read) for read in reads]
            for _ in range(round_ % 8):  # each is midway, connecting or sending or reading
                await asyncio.sleep(0)
            await client.aclose()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                kind = type(result) if isinstance(result, BaseException) else list
                kinds[kind] = kinds.get(kind, 0) + 1
    finally:
        await client.aclose()
    assert set(kinds) <= {list, redis.ConnectionError}, kinds
    assert kinds.get(redis.ConnectionError, 0) > 0, kinds  # the race was run


def command_getkeys_calls(cluster_url: str) -> int:
    client: Any = sync_client(cluster_url, cluster=True)  # a RedisCluster
    try:
        stats = [client.get_redis_connection(n).info("commandstats") for n in client.get_nodes()]
    finally:
        client.close()
    return sum(s.get("cmdstat_command|getkeys", {}).get("calls", 0) for s in stats)


async def test_stream_reads_on_a_cluster_go_straight_to_their_node(redis_cluster_url: str) -> None:
    """redis-py asks a node for an XREAD's keys (COMMAND GETKEYS, twice) before each read:
    the runtime's cluster clients route reads by their stream's slot instead."""
    stream = f"s{uuid.uuid4().hex}"
    aio, sync = (
        async_client(redis_cluster_url, cluster=True),
        sync_client(redis_cluster_url, cluster=True),
    )
    try:
        entry = await aio.xadd(stream, {"a": "1"})
        await aio.xgroup_create(stream, "g", id="0")
        before = command_getkeys_calls(redis_cluster_url)
        for _ in range(10):
            assert await aio.xread({stream: "0-0"}, count=1) == [
                [stream.encode(), [(entry, {b"a": b"1"})]]
            ]
            assert sync.xread({stream: "0-0"}, count=1) == [
                [stream.encode(), [(entry, {b"a": b"1"})]]
            ]
        assert await aio.xreadgroup("g", "c", {stream: ">"}, count=1) != []
        assert command_getkeys_calls(redis_cluster_url) == before
    finally:
        await aio.aclose()
        sync.close()
