"""The `serve` process: the HTTP app on uvicorn, over a given Redis or an embedded deployment.

With no Redis URL it starts what `run` starts (a private Redis, the orchestrator
and every worker as subprocesses, each with every setting `serve` was given), starts
again any of them that dies (`ProcessGroup.restart_dead`), and stops them when it
exits, on SIGINT, SIGTERM or SIGHUP alike; they die with it if it is killed
(`parent_death`). With a URL, it is just another client and any number of
replicas may run side by side.
Several pipelines (`--pipeline` repeated, or a comma list) run each in a namespace of
its own (`gateway.namespace_for`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
from pathlib import Path
from types import FrameType

import uvicorn

from omni_runtime.errors import OmniError
from omni_runtime.http.app import create_app
from omni_runtime.http.flags import add_serve_arguments as add_serve_arguments
from omni_runtime.http.gateway import Gateway, check_served
from omni_runtime.http.settings import ServeSettings
from omni_runtime.local.forked import Children
from omni_runtime.local.launcher import ProcessGroup, child_env, local_redis, settings_env
from omni_runtime.pipeline import PipelineConfig, load_pipeline
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings

log = logging.getLogger(__name__)

SUPERVISE_EVERY_S = 0.5
"""How often `serve` looks for a dead process of its deployment, and for a stop signal."""
CUT_MARGIN_S = 2
"""uvicorn cuts connections this long after the drain ended the requests in flight."""


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    flags = ("host", "port", "max_inflight", "allow_unauthenticated")
    given = {f: getattr(args, f) for f in flags if getattr(args, f, None) is not None}
    return ServeSettings.load(**given)


def pipeline_paths(given: str | list[str]) -> list[str]:
    """`--pipeline` values, each a file or a comma list of files."""
    values = [given] if isinstance(given, str) else given
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


def run_serve(
    args: argparse.Namespace, settings: Settings, children: Children, log_args: list[str]
) -> int:
    """`omni-runtime serve`: returns the exit code (1 if an embedded process kept dying).
    `children` is what an embedded deployment forks (the command line's entry point),
    `log_args` the logging flags each of its processes is given."""

    paths = pipeline_paths(args.pipeline)
    # streaming unless the file or --mode says otherwise: a served answer's audio starts
    # with its first words, as the playground says it does
    mode = getattr(args, "mode", None)
    pipelines = [load_pipeline(p, mode=mode, default_mode="streaming") for p in paths]
    # what no request could fix (no `outputs`, two of one name) fails now
    namespaces = check_served(pipelines, settings.namespace)
    serve = serve_settings(args)
    serve.check_exposure()
    # Before and after serving (`_serve`), SIGTERM and SIGHUP are a KeyboardInterrupt, as
    # SIGINT is: their default action would end this process before it stops the processes
    # it started.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    try:
        served = list(zip(paths, pipelines, namespaces, strict=True))
        return _run_serve(settings, served, serve, children, log_args)
    except KeyboardInterrupt:
        return 0


def _run_serve(
    settings: Settings,
    served: list[tuple[str, PipelineConfig, str]],
    serve: ServeSettings,
    children: Children,
    log_args: list[str],
) -> int:
    """`served`: each pipeline's file, config and namespace."""
    with local_redis(settings.redis_url, settings.startup_timeout_s) as (url, how):
        groups: list[ProcessGroup] = []
        embedded = settings.redis_url is None
        settings = settings.model_copy(update={"redis_url": url})
        try:
            for path, pipeline, namespace in served:
                if embedded:  # every setting, however given, reaches every process started
                    own = settings.model_copy(update={"namespace": namespace})
                    env = child_env(url, settings_env(own))
                    group = ProcessGroup(
                        Path(path), pipeline, env, fork=children, args=log_args, settings=own
                    )
                    groups.append(group)
                    group.start()
                logs = f"; its processes log to {groups[-1].log_dir}" if embedded else ""
                log.info(
                    "pipeline %r (%s mode) in namespace %r on %s%s",
                    pipeline.name, pipeline.mode, namespace, how, logs,
                )  # fmt: skip
            pipelines = [pipeline for _path, pipeline, _ns in served]
            gateway = Gateway(
                pipelines,
                settings,
                RedisClients.connect(
                    settings.redis_url, settings.redis_cluster, settings.namespace
                ),
                serve,
            )
            return asyncio.run(_serve(gateway, serve, groups, settings.drain_s))
        finally:
            for group in groups:
                group.stop()


class DrainingServer(uvicorn.Server):
    """uvicorn, whose first stop signal only asks for the drain (`stop_requested`): uvicorn
    closes every WebSocket at once when its shutdown begins, so `serve` holds that back
    until the realtime sessions' responses and the background responses are done. A second
    signal begins uvicorn's shutdown at once, a second Ctrl-C (SIGINT) ending it at once
    too, as in uvicorn."""

    stop_requested = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.stop_requested:
            self.stop_requested = True
            return
        self.should_exit = True
        super().handle_exit(sig, frame)


async def _serve(
    gateway: Gateway, serve: ServeSettings, groups: list[ProcessGroup], drain_s: float
) -> int:
    """Serve until a stop signal; then accept nothing more and give the requests in flight
    `drain_s` (`OMNI_DRAIN_S`) to finish before they are cut (`Gateway.cut_all`), which
    leaves uvicorn's own cut (`CUT_MARGIN_S` later) only connections that do not close."""
    config = uvicorn.Config(
        create_app(gateway),
        host=serve.host,
        port=serve.port,
        lifespan="on",
        # the sans-I/O protocol hands the app a client's close frame at once; the legacy
        # one (`auto` before uvicorn 0.50) holds it until the TCP connection closes, which a
        # client not reading the server's backlog delays by its close timeout (10 s)
        ws="websockets-sansio",
        timeout_graceful_shutdown=math.ceil(drain_s) + CUT_MARGIN_S,
        log_config=None,  # keep the process's logging setup
    )
    server = DrainingServer(config)
    # Each stop signal is a graceful shutdown, SIGHUP too (uvicorn takes only SIGINT and
    # SIGTERM), from now on (uvicorn takes them only once it runs) and once uvicorn has
    # stopped (it raises the signal again then, for a KeyboardInterrupt in a task).
    stop_signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in stop_signals}
    try:
        return await _serve_until_stopped(server, groups, gateway, drain_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _serve_until_stopped(
    server: DrainingServer, groups: list[ProcessGroup], gateway: Gateway, drain_s: float
) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(server.serve())
    drain_ends: float | None = None
    cut: asyncio.TimerHandle | None = None
    while not task.done() and not server.should_exit:
        if server.stop_requested and drain_ends is None:
            drain_ends = loop.time() + drain_s
            cut = loop.call_later(drain_s, gateway.cut_all)
            _stop_listening(server)
            gateway.stop()
        if drain_ends is not None and (
            not (gateway.sessions or gateway.background) or loop.time() > drain_ends + CUT_MARGIN_S
        ):
            # what is left is HTTP, which uvicorn's shutdown waits for, till the drain's end
            left = math.ceil(max(0.0, drain_ends - loop.time()))
            server.config.timeout_graceful_shutdown = left + CUT_MARGIN_S
            server.should_exit = True
            break
        try:
            for group in groups:
                group.restart_dead()
        except OmniError as e:  # an embedded process that keeps dying: stop serving, say why
            log.error("%s", e)
            server.should_exit = True
            gateway.cut_all()
            await task
            return 1
        await asyncio.wait({task}, timeout=SUPERVISE_EVERY_S)
    if cut is None:  # stopped at once (uvicorn's own signal handling, or its exit)
        cut = loop.call_later(drain_s, gateway.cut_all)
    await task
    cut.cancel()
    return 0 if server.started else 1


def _stop_listening(server: uvicorn.Server) -> None:
    """New connections are refused at once, as in uvicorn's shutdown; open ones are kept.
    (A signal before uvicorn listens finds none: its startup then ends in its shutdown.)"""
    for listener in getattr(server, "servers", []):
        listener.close()
