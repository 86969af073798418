"""A private Redis Cluster for tests, benchmarks and CI: `redis-server`s in cluster mode.

Three (or more) `RedisServer`s with every slot assigned, the smallest real Redis Cluster.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from omni_runtime.errors import FatalError, StartupTimeoutError
from omni_runtime.redis_server import RedisServer, free_port

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
    """A private Redis Cluster: `masters` `redis-server --cluster-enabled yes` nodes, no replicas.

    Slots are split evenly (CLUSTER ADDSLOTS), the nodes meet (CLUSTER MEET), and
    `start()` returns once every node reports `cluster_state:ok` and knows the others:
    what `redis-cli --cluster create ... --cluster-replicas 0` does, without needing
    redis-cli. `url` is the first node's; any node's URL reaches the whole cluster.
    """

    def __init__(
        self, masters: int = 3, binary: str | None = None, timeout_s: float = 20.0
    ) -> None:
        if masters < 1:
            raise FatalError(f"a cluster needs at least one master, got {masters}")
        self.masters = masters
        self.binary = binary
        self.timeout_s = timeout_s
        self.nodes: list[RedisServer] = []
        self.dir: Path | None = None

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self) -> RedisCluster:
        self.dir = Path(tempfile.mkdtemp(prefix="omni-redis-cluster-"))
        try:
            for i in range(self.masters):
                node_dir = self.dir / f"node{i}"
                node_dir.mkdir()
                conf = str(node_dir / "nodes.conf")
                args = ["--cluster-enabled", "yes", "--dir", str(node_dir)]
                args += ["--cluster-config-file", conf, "--cluster-node-timeout", "5000"]
                node = RedisServer(
                    self.binary,
                    node_dir / "redis.log",
                    self.timeout_s,
                    tuple(args),
                    cluster_node_port,
                )
                self.nodes.append(node.start())
            self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self) -> None:
        import redis

        clients = [redis.Redis.from_url(url, socket_timeout=self.timeout_s) for url in self.urls]
        try:
            from omni_runtime.redis_io.clients import CLUSTER_SLOTS

            per_node = -(-CLUSTER_SLOTS // self.masters)
            for i, client in enumerate(clients):
                slots = range(i * per_node, min((i + 1) * per_node, CLUSTER_SLOTS))
                client.execute_command("CLUSTER ADDSLOTS", *slots)  # type: ignore[no-untyped-call]
            for node in self.nodes[1:]:
                clients[0].execute_command(  # type: ignore[no-untyped-call]
                    "CLUSTER MEET", "127.0.0.1", node.port
                )
            deadline = time.monotonic() + self.timeout_s
            while not all(self._ready(c) for c in clients):
                if time.monotonic() > deadline:
                    raise StartupTimeoutError(
                        f"Redis Cluster on ports {[n.port for n in self.nodes]} did not reach "
                        f"cluster_state:ok within {self.timeout_s:g}s"
                    )
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()

    def _ready(self, client: redis.Redis) -> bool:
        from omni_runtime.redis_io.clients import CLUSTER_SLOTS, cluster_info

        fields = cluster_info(client)
        return (
            fields.get("cluster_state") == "ok"
            and fields.get("cluster_known_nodes") == str(self.masters)
            and fields.get("cluster_slots_ok") == str(CLUSTER_SLOTS)
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
