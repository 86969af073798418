"""Health and readiness beside `/metrics`: what a Kubernetes probe (or a load balancer) asks.

`/health` answers 200 while the process serves at all: its watchdog already stops a process
whose loops are stuck, so liveness needs nothing more. `/ready` answers 200 only while the
process takes work: a worker once its heartbeat is in Redis (it is registered, its engine
started) and until it drains or its engine fails its health check; an orchestrator while it
holds its slot's lease, fresh, and until it stops. Not ready, it answers 503 and says why.
Every other path is the metrics exposition.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised

Check = Callable[[], str | None]
"""None when all is well, else why not (one line)."""

HEALTH_PATH = "/health"
READY_PATH = "/ready"


def _always() -> str | None:
    return None


@dataclass(frozen=True)
class Probes:
    """A process's two answers; either may be left as always well."""

    ready: Check = _always
    live: Check = _always


class _Quiet(WSGIRequestHandler):
    """No access log line per scrape or probe."""

    def log_message(self, format: str, *args: Any) -> None:
        return


def probes_app(probes: Probes, metrics_app: Any) -> Any:
    """A WSGI app: `/health` and `/ready` from `probes`, anything else from `metrics_app`."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        check = {HEALTH_PATH: probes.live, READY_PATH: probes.ready}.get(path)
        if check is None:
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]
        checked = foreign.call(check)  # the process's own check, handed in
        if isinstance(checked, Raised):  # a probe that raises answers "not well", never a 500
            why: str | None = f"probe failed: {checked.error!r}"
        else:
            why = checked
        body = ("ok" if why is None else why).encode() + b"\n"
        status = "200 OK" if why is None else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    return app


def serve_wsgi(app: Any, port: int, addr: str) -> tuple[Any, threading.Thread]:
    """`app` on `addr:port` from a daemon thread (port 0: any free port)."""
    from prometheus_client.exposition import ThreadingWSGIServer  # ~0.1 s: only when serving

    server = make_server(addr, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread
