"""A replica taking over a dead one's inputs first closes the dead one's connections: one
that only stalled (SIGSTOP) would otherwise land, on waking, a write that passed its fence
just before the stall. Closed, that write fails, and its retry meets the fence."""

from __future__ import annotations

import pytest
import redis

from omni_runtime import keys
from omni_runtime.observe.metrics import Metrics
from omni_runtime.redis_io.backoff import RetrySettings
from omni_runtime.redis_io.streams import SyncGroupReader
from omni_runtime.settings import Settings
from omni_runtime.wire import codec
from omni_runtime.wire.messages import StageInputMsg
from omni_runtime.wire.views import StageInputView
from omni_runtime.worker.actions import Input
from omni_runtime.worker.takeover import Takeover, TakeoverSettings, name_connections

pytestmark = pytest.mark.timeout(30)


def named(client: redis.Redis, name: str) -> list[dict[str, str]]:
    return [c for c in client.client_list() if c.get("name") == name]


def test_a_takeover_closes_the_dead_replicas_connections_first(redis_url: str) -> None:
    settings = Settings(redis_url=redis_url, namespace="t")
    names, stream = settings.names, settings.names.stage_in(1)
    live = redis.Redis.from_url(redis_url)
    stalled = redis.Redis.from_url(redis_url)
    name_connections(stalled, names, 1, "stalled-1")
    live.xgroup_create(stream, keys.WORKERS_GROUP, id="0", mkstream=True)
    msg = StageInputMsg(request_id="r1", data="x", streaming=False)
    live.xadd(stream, {keys.PAYLOAD_FIELD: codec.encode_model(msg)})
    stalled.xreadgroup(keys.WORKERS_GROUP, "stalled-1", {stream: ">"})  # in flight there
    connection = names.worker_connection(1, "stalled-1")
    assert len(named(live, connection)) == 1  # its connection carries its name
    delivered: list[Input] = []
    reader = SyncGroupReader(
        live, stream, keys.WORKERS_GROUP, "live-1", StageInputView,
        max_bytes=1 << 20, dead_letters=names.dead_letters,
    )  # fmt: skip
    takeover = Takeover(
        live, reader, delivered.extend, settings.part(TakeoverSettings, retry=settings.part(RetrySettings)),
        worker_id="live-1", stage_id=1, metrics=Metrics(),
    )  # fmt: skip
    takeover.min_idle_ms = 0  # claimable at once ("stalled-1" has no heartbeat)
    takeover()
    assert [i.msg.request_id for i in delivered] == ["r1"]
    assert named(live, connection) == []  # closed: a late write of its would fail
    live.close()
    stalled.close()
