"""A private Redis Cluster for tests, benchmarks and CI: `redis-server`s in cluster mode.

Three (or more) `RedisServer`s with every slot assigned, the smallest real Redis Cluster;
with `replicas`, that many replicas of each primary, so a primary's death fails over.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omni_runtime.errors import FatalError, StartupTimeoutError
from omni_runtime.local.redis_server import RedisServer, free_port

if TYPE_CHECKING:
    import redis

CLUSTER_BUS_OFFSET = 10000
"""A cluster node also listens on its port + this (the cluster bus)."""


def cluster_node_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    while True:
        port = free_port()
        if port + CLUSTER_BUS_OFFSET > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
            except OSError:
                continue
        return port


class RedisCluster:
    """A private Redis Cluster: `masters` `redis-server --cluster-enabled yes` primaries,
    each with `replicas` replicas.

    Slots are split evenly (CLUSTER ADDSLOTS), the nodes meet (CLUSTER MEET), replicas
    follow their primary (CLUSTER REPLICATE), and `start()` returns once every node reports
    `cluster_state:ok` and knows the others and every replica is in sync: what `redis-cli
    --cluster create ... --cluster-replicas N` does, without needing redis-cli. `url` is
    the first node's; any node's URL reaches the whole cluster. `node_timeout_ms` is how
    long a primary may be silent before its replica takes over.
    """

    def __init__(
        self,
        masters: int = 3,
        binary: str | None = None,
        timeout_s: float = 20.0,
        replicas: int = 0,
        node_timeout_ms: int = 5000,
    ) -> None:
        if masters < 1:
            raise FatalError(f"a cluster needs at least one master, got {masters}")
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.binary = binary
        self.timeout_s = timeout_s
        self.nodes: list[RedisServer] = []
        """The primaries, then the replicas (of primary i: `nodes[masters * (1 + r) + i]`),
        as started: a failover swaps their roles."""
        self.dir: Path | None = None

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self) -> RedisCluster:
        self.dir = Path(tempfile.mkdtemp(prefix="omni-redis-cluster-"))
        with contextlib.ExitStack() as unless_started:  # no node is left running
            unless_started.callback(self.stop)
            for i in range(self.masters * (1 + self.replicas)):
                node_dir = self.dir / f"node{i}"
                node_dir.mkdir()
                conf = str(node_dir / "nodes.conf")
                args = ["--cluster-enabled", "yes", "--dir", str(node_dir)]
                args += ["--cluster-config-file", conf]
                args += ["--cluster-node-timeout", str(self.node_timeout_ms)]
                node = RedisServer(
                    self.binary,
                    node_dir / "redis.log",
                    self.timeout_s,
                    tuple(args),
                    cluster_node_port,
                )
                self.nodes.append(node.start())
            self._form()
            unless_started.pop_all()
        return self

    def _form(self) -> None:
        import redis

        clients = [redis.Redis.from_url(url, socket_timeout=self.timeout_s) for url in self.urls]
        try:
            from omni_runtime.redis_io.clients import CLUSTER_SLOTS

            per_node = -(-CLUSTER_SLOTS // self.masters)
            for i, client in enumerate(clients[: self.masters]):
                slots = range(i * per_node, min((i + 1) * per_node, CLUSTER_SLOTS))
                client.execute_command("CLUSTER ADDSLOTS", *slots)
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER MEET", "127.0.0.1", node.port)
            deadline = time.monotonic() + self.timeout_s
            ids = [c.execute_command("CLUSTER MYID") for c in clients[: self.masters]]
            for n, client in enumerate(clients[self.masters :]):
                primary_id = ids[n % self.masters]
                while True:  # a replica can follow only a primary it has heard of
                    try:
                        client.execute_command("CLUSTER REPLICATE", primary_id)
                        break
                    except redis.ResponseError:
                        self._check(deadline)
                        time.sleep(0.05)
            while not all(self._ready(c) for c in clients):
                self._check(deadline)
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()

    def _check(self, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise StartupTimeoutError(
                f"Redis Cluster on ports {[n.port for n in self.nodes]} did not reach "
                f"cluster_state:ok with every replica in sync within {self.timeout_s:g}s"
            )

    def _ready(self, client: redis.Redis) -> bool:
        from omni_runtime.redis_io.clients import CLUSTER_SLOTS, cluster_info

        fields = cluster_info(client)
        replication = client.info("replication")
        return (
            fields.get("cluster_state") == "ok"
            and fields.get("cluster_known_nodes") == str(len(self.nodes))
            and fields.get("cluster_slots_ok") == str(CLUSTER_SLOTS)
            and replication.get("master_link_status", "up") == "up"
            and (replication["role"] != "master" or self._has_replicas(replication))
        )

    def _has_replicas(self, replication: dict[str, object]) -> bool:
        return int(str(replication.get("connected_slaves", 0))) >= self.replicas

    def wait_failover(self, dead_port: int, timeout_s: float) -> None:
        """Return once the live nodes hold the node on `dead_port` failed and serve every
        slot again (its replica promoted); StartupTimeoutError after `timeout_s`."""
        import redis

        live = [n for n in self.nodes if n.port != dead_port and n.proc is not None]
        clients = [redis.Redis(port=n.port, socket_timeout=2) for n in live]
        deadline = time.monotonic() + timeout_s
        try:
            while not self._failed_over(clients, dead_port):
                if time.monotonic() > deadline:
                    raise StartupTimeoutError(
                        f"Redis Cluster did not fail over from port {dead_port} within "
                        f"{timeout_s:g}s: {self._describe(clients)}"
                    )
                time.sleep(0.02)
        finally:
            for client in clients:
                client.close()

    def _failed_over(self, clients: list[redis.Redis], dead_port: int) -> bool:
        import redis

        try:
            # redis-py parses the reply: address -> fields
            nodes = cast(dict[str, Any], clients[0].execute_command("CLUSTER NODES"))
            dead = [v for k, v in nodes.items() if str(k).endswith(f":{dead_port}")]
            if not dead or "fail" not in str(dead[0].get("flags", "")).split(","):
                return False
            return all(self._serving(c) for c in clients)
        except redis.RedisError:
            return False

    def _describe(self, clients: list[redis.Redis]) -> str:
        import redis

        try:
            nodes = clients[0].execute_command("CLUSTER NODES")
            return str(nodes) + " | " + " | ".join(str(c.info("replication")) for c in clients)
        except redis.RedisError as e:
            return str(e)

    def _serving(self, client: redis.Redis) -> bool:
        from omni_runtime.redis_io.clients import CLUSTER_SLOTS, cluster_info

        fields = cluster_info(client)
        return fields.get("cluster_state") == "ok" and fields.get("cluster_slots_ok") == str(
            CLUSTER_SLOTS
        )

    def stop(self) -> None:
        """Stop every node and delete their directory. Idempotent."""
        for node in self.nodes:
            node.stop()
        self.nodes = []
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
