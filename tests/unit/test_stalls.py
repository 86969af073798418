"""StallWatch, over fakeredis with a hand-driven clock: a process is stalled once its
heartbeat key, there before, has been missing `STALL_TTLS` TTLs; never before it beat."""

from __future__ import annotations

import fakeredis

from omni_runtime.local.stalls import STALL_TTLS, StallWatch

TTL_S = 5.0


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_process_is_stalled_only_once_its_key_was_gone_long_enough() -> None:
    client, clock = fakeredis.FakeRedis(), Clock()
    watch = StallWatch(client, TTL_S, clock)
    keys = {"worker": "hb:worker", "loading": "hb:loading"}
    assert watch.stalled(keys) == []  # neither has beaten: the worker is starting
    client.set("hb:worker", "{}")
    assert watch.stalled(keys) == []
    client.delete("hb:worker")  # it stopped beating
    clock.now += 1
    assert watch.stalled(keys) == []
    clock.now += STALL_TTLS * TTL_S - 1.5
    assert watch.stalled(keys) == []
    client.set("hb:worker", "{}")  # it beat again in time (Redis had lost its keys)
    assert watch.stalled(keys) == []
    client.delete("hb:worker")
    assert watch.stalled(keys) == []
    clock.now += STALL_TTLS * TTL_S
    assert watch.stalled(keys) == ["worker"]  # the one still loading never counts
    assert watch.missing_for_s("hb:worker") == STALL_TTLS * TTL_S


def test_redis_out_of_reach_judges_nobody() -> None:
    server = fakeredis.FakeServer()
    client, clock = fakeredis.FakeRedis(server=server), Clock()
    watch = StallWatch(client, TTL_S, clock)
    client.set("hb:worker", "{}")
    assert watch.stalled({"worker": "hb:worker"}) == []
    server.connected = False
    clock.now += 10 * STALL_TTLS * TTL_S
    assert watch.stalled({"worker": "hb:worker"}) == []
