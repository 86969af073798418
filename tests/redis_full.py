"""A real redis-server of a test's own that can be made to refuse writes for memory.

`maxmemory 1` with `noeviction`: Redis then refuses every command that may grow memory
(XADD, HSET, SET, and everything queued in a MULTI) with `OOM command not allowed`, and
still runs the rest (XACK, XDEL, HDEL, PEXPIRE, reads). The session's shared server is
never configured so: other tests use it. `short(room)` leaves `room` bytes above what
Redis uses now instead: it refuses a command bigger than that (its own bytes count) and
runs a smaller one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from tests.faults.private_redis import PrivateRedis


class FullableRedis(PrivateRedis):
    """`PrivateRedis`, plus `full()`: every write refused for memory while inside it."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.admin: redis.Redis | None = None

    def start(self) -> None:
        super().start()
        self.admin = redis.Redis.from_url(self.url)
        self.admin.config_set("maxmemory-policy", "noeviction")

    def kill(self) -> None:
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        super().kill()

    def set_full(self, full: bool) -> None:
        assert self.admin is not None
        self.admin.config_set("maxmemory", 1 if full else 0)

    @contextmanager
    def full(self) -> Iterator[None]:
        self.set_full(True)
        try:
            yield
        finally:
            if self.admin is not None:
                self.set_full(False)

    @contextmanager
    def short(self, room_bytes: int) -> Iterator[None]:
        assert self.admin is not None
        used = int(self.admin.info("memory")["used_memory"])
        self.admin.config_set("maxmemory", used + room_bytes)
        try:
            yield
        finally:
            if self.admin is not None:
                self.set_full(False)
