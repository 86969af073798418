"""Tracing one request on demand, in a deployment whose tracing is off.

A request submitted with `trace` set (`OmniClient.submit(trace=True)`, `submit --trace`,
the `X-Omni-Trace: 1` header) carries the flag on its `RequestMsg` and its
`StageInputMsg`s, so every process it passes through stamps it into Redis
(`<ns>:trace:<id>`, read by `omni-runtime trace ID`), as `OMNI_TRACE=1` would for all.

The cost when nothing is traced stays what it is with tracing off: the stamp sites
check `tracer is not None` (or a message's flag), and nothing else. That is why the
router (the orchestrator) switches its tracer of the moment (`Observability.tracer`, which
its parts read at each stamp) to an `OnDemandTracer` only while a traced request is in
flight, and back to `None` after (`Observability.begin_trace`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_runtime import keys
from omni_runtime.observe.tracing import RedisTracer, Tracer

FINISHED = "request_finished"
"""The router's stamp of a request's last output: a request traced on demand ends there."""


class LazyRedisTracer:
    """A `RedisTracer` (a client and a thread) started by the first stamp, not before."""

    def __init__(self, redis_client: Callable[[], Any], names: keys.Names, ttl_s: int) -> None:
        self.redis_client, self.names, self.ttl_s = redis_client, names, ttl_s
        self.tracer: RedisTracer | None = None

    def stamp(
        self, event: str, request_id: str, stage_id: int | None = None, t_ns: int | None = None
    ) -> None:
        if self.tracer is None:
            client = self.redis_client()
            self.tracer = RedisTracer(client, self.names, self.ttl_s, close_client=True).start()
        self.tracer.stamp(event, request_id, stage_id, t_ns)

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()


class OnDemandTracer:
    """Stamps the requests in `requests` only; a request leaves it at its `FINISHED` stamp."""

    def __init__(
        self,
        tracer: Tracer,
        on_idle: Callable[[], None] = lambda: None,
        requests: set[str] | None = None,
    ) -> None:
        self.tracer = tracer
        self.requests: set[str] = set() if requests is None else requests
        """The requests traced (`Observability.traced`, which the router's parts read)."""
        self.on_idle = on_idle
        """Called when the last traced request has finished."""

    def stamp(
        self, event: str, request_id: str, stage_id: int | None = None, t_ns: int | None = None
    ) -> None:
        if request_id not in self.requests:
            return
        self.tracer.stamp(event, request_id, stage_id, t_ns)
        if event == FINISHED:
            self.requests.discard(request_id)
            if not self.requests:
                self.on_idle()
