"""The stats poller reads every stream in one pipeline: the same figures as one at a time."""

from __future__ import annotations

import pytest

from omni_runtime import keys
from omni_runtime.observe.poller import read_streams
from omni_runtime.observe.redis_stats import read_stream, server_now
from omni_runtime.redis_io.clients import probe, sync_client

pytestmark = pytest.mark.timeout(60)


def test_pipelined_stream_reads_match_one_at_a_time(any_redis_url: str) -> None:
    """Entries pending in one group, none in another, a stream with no group, an empty
    stream and one that does not exist, on a single server and across a cluster's shards."""
    names = keys.Names("stats")
    client = sync_client(any_redis_url, cluster=probe(any_redis_url))
    try:
        busy, quiet, bare, empty = (
            names.stage_in(0),
            names.stage_out(0),
            names.requests,
            names.control,
        )
        for i in range(5):
            client.xadd(busy, {"m": str(i)})
            client.xadd(bare, {"m": str(i)})
        client.xgroup_create(busy, "g1", id="0")
        client.xgroup_create(busy, "g2", id="$")
        client.xreadgroup("g1", "c", {busy: ">"}, count=3)
        client.xgroup_create(quiet, "g", id="0", mkstream=True)
        client.xadd(empty, {"m": "x"})
        client.xtrim(empty, maxlen=0)
        streams = [busy, quiet, bare, empty, names.dead_letters]
        _, now_ms = server_now(client)
        one_by_one = [info for s in streams if (info := read_stream(client, s, now_ms))]
        together = read_streams(client, streams, now_ms)
    finally:
        client.close()
    assert together == one_by_one
    assert [s.name for s in together] == [busy, quiet, bare, empty]
    pending = {g.name: (g.pending, g.oldest_pending_age_s is not None) for g in together[0].groups}
    assert pending == {"g1": (3, True), "g2": (0, False)}
