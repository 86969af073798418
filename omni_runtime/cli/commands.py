"""What each `omni-runtime` subcommand does, given its parsed arguments: calls into the library."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from pydantic_settings import CliSettingsSource

from omni_runtime.cli.console import (
    OutputPrinter,
    check_wav_path,
    parse_params,
    read_input,
    write_wav,
)
from omni_runtime.core.tasks import cancel_and_wait
from omni_runtime.errors import ConfigError, OmniError
from omni_runtime.local.forked import Children
from omni_runtime.pipeline import PipelineConfig, check_stage_options, load_pipeline
from omni_runtime.settings import Settings

log = logging.getLogger(__name__)

CLIENT_CLOSE_S = 1.0
"""How long a stopped `run` or `submit` gives its client to end its request."""


def settings_of(args: argparse.Namespace) -> Settings:
    source: CliSettingsSource[Settings] = args.settings_source
    return Settings.load(source(parsed_args=args), args.settings_file)


def logging_args(args: argparse.Namespace) -> list[str]:
    """The logging flags this process was given, for the processes it starts."""
    level = "DEBUG" if args.verbose else args.log_level
    return ["--log-level", level, "--log-format", args.log_format]


def log_settings(settings: Settings) -> None:
    """What this process runs with, whichever way each setting came (debug logging)."""
    from omni_runtime.redis_io.clients import redacted

    values = settings.model_dump()
    if values.get("redis_url"):
        values["redis_url"] = redacted(values["redis_url"])
    log.debug("settings: %s", json.dumps(values, default=str, sort_keys=True))


def _pipeline(args: argparse.Namespace) -> PipelineConfig:
    return load_pipeline(args.pipeline, mode=getattr(args, "mode", None))


def _wav_rate(pipeline: PipelineConfig) -> int:
    """The audio's sample rate as the pipeline file states it (`outputs.sample_rate`)."""
    return pipeline.outputs.sample_rate if pipeline.outputs is not None else 16000


# --- long-running processes ---------------------------------------------------


def cmd_orchestrator(args: argparse.Namespace) -> int:
    from omni_runtime.orchestrator.proc import OrchestratorService

    settings = settings_of(args)
    log_settings(settings)
    service = OrchestratorService(
        _pipeline(args), settings, orchestrator_id=args.orchestrator_id, replaces=args.replaces
    )

    async def main() -> NoReturn:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, stop.set)
        await service.run(stop)
        # Left from inside the loop: closing it would put the default actions back, and a
        # stop signal then (`run` sends its children two as it stops them) killed a process
        # that had stopped cleanly, or printed a KeyboardInterrupt's traceback.
        exit_now(0)

    asyncio.run(main())


def cmd_worker(args: argparse.Namespace) -> int:
    from omni_runtime.worker.proc import StageWorker
    from omni_runtime.worker.signals import block_stop_signals, take_stop_signals

    block_stop_signals()  # before any thread starts: the stage code's imports may start some
    pipeline = _pipeline(args)
    check_stage_options(pipeline, [args.stage])
    settings = settings_of(args)
    log_settings(settings)
    worker = StageWorker(
        pipeline, args.stage, settings, worker_id=args.worker_id, replaces=args.replaces
    )
    take_stop_signals(worker.stop)
    worker.run()
    stuck = [
        t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()
    ]
    if stuck:  # stage code that ignores aborts must not keep a stopped worker alive
        logging.getLogger(__name__).warning(
            "exiting with stage code still running on %s", ", ".join(stuck)
        )
    exit_now(0)


def exit_now(code: int) -> NoReturn:
    """Leave a stopped process without tearing its interpreter down: everything was closed
    and flushed, and the teardown of its modules and objects (redis, pydantic, numpy) takes
    0.1-0.5 s for nothing. Exit handlers still run; logs and output are flushed."""
    atexit._run_exitfuncs()
    logging.shutdown()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


# --- clients ------------------------------------------------------------------


async def _submit_and_print(
    settings: Settings,
    prompt: str,
    printer: OutputPrinter,
    stage_ids: list[int],
    trace: bool = False,
    params: dict[str, Any] | None = None,
) -> None:
    from omni_runtime.client.client import OmniClient

    async with OmniClient(settings) as client:
        await client.wait_ready(stage_ids)
        printer.restart_clock()
        request_id = await client.submit(prompt, trace=trace, params=params)
        if trace:  # on stderr: stdout stays the outputs
            print(
                f"request {request_id} is traced: omni-runtime trace {request_id}", file=sys.stderr
            )
        async for out in client.stream(request_id):
            printer(out)


def cmd_submit(args: argparse.Namespace) -> int:
    pipeline = _pipeline(args)
    prompt = read_input(pipeline, args.prompt, args.prompt_file)
    check_wav_path(args.wav)
    printer = OutputPrinter()
    stage_ids = list(range(pipeline.last_stage + 1))
    settings = settings_of(args)  # `--trace`: this request is traced in every process
    params = parse_params(args.param)
    submitted = _submit_and_print(settings, prompt, printer, stage_ids, settings.trace, params)
    asyncio.run(_watch(None, submitted))
    write_wav(printer, args.wav, _wav_rate(pipeline))
    return 1 if printer.failed else 0


_STOPPED_BY: list[int] = []
"""The stop signals `run` received, first first."""


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    """SIGTERM and SIGHUP do what Ctrl-C does, by whatever takes SIGINT at the moment:
    `asyncio.run`'s handler (the request's task is cancelled) or a KeyboardInterrupt."""
    _STOPPED_BY.append(signum)
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler):
        raise KeyboardInterrupt
    handler(signal.SIGINT, frame)


def cmd_run(args: argparse.Namespace, children: Children) -> int:
    """Its start-up overlaps: the redis-server starts while this process imports and
    checks what its children need, and they are forked from it (`forked`). Once every
    process has stopped it leaves at once (`exit_now`), after a Ctrl-C as well.

    SIGINT, SIGTERM and SIGHUP stop it alike: every process it started, then its Redis,
    and it exits with 128 + the signal's number."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_stop_signal)
    try:
        code = _run(args, children)
    except KeyboardInterrupt:
        code = 128 + (_STOPPED_BY[0] if _STOPPED_BY else signal.SIGINT)
    exit_now(code)


def _run(args: argparse.Namespace, children: Children) -> int:
    from omni_runtime.cli.startup import import_redis
    from omni_runtime.local.forked import preload
    from omni_runtime.local.launcher import ProcessGroup, child_env, settings_env, starting_redis

    pipeline = _pipeline(args)
    settings = settings_of(args)
    prompt = read_input(pipeline, args.prompt, args.prompt_file)
    params = parse_params(args.param)
    check_wav_path(args.wav)
    printer = OutputPrinter()
    with starting_redis(settings.redis_url, settings.startup_timeout_s) as redis_ready:
        import_redis()
        if settings.redis_url is not None:  # unusable: one line now, not one per process later
            from omni_runtime.redis_io.clients import RedisClients

            RedisClients.connect(settings.redis_url, settings.redis_cluster, settings.namespace)
        check_stage_options(pipeline, range(pipeline.last_stage + 1))
        preload(children)
        url, how = redis_ready()
        print(f"pipeline {pipeline.name!r} ({pipeline.mode} mode) on {how}", flush=True)
        run_settings = settings.model_copy(update={"redis_url": url})
        env = child_env(url, settings_env(run_settings))  # every setting, however given
        group = ProcessGroup(
            Path(args.pipeline), pipeline, env, fork=children, args=logging_args(args)
        )
        failed = True  # until the request has ended well; a Ctrl-C is no failure
        try:
            group.start()
            stage_ids = list(range(pipeline.last_stage + 1))
            submitted = _submit_and_print(run_settings, prompt, printer, stage_ids, params=params)
            asyncio.run(_watch(group, submitted))
            failed = printer.failed
        except KeyboardInterrupt:
            failed = False
            raise
        finally:  # the processes stop before the Redis they use (`starting_redis` exits after)
            kept = group.stop(keep_failed_logs=True, failed=failed)
            if kept is not None:
                print(f"logs kept in {kept}", file=sys.stderr, flush=True)
    write_wav(printer, args.wav, _wav_rate(pipeline))
    print(printer.summary())
    return 1 if printer.failed else 0


async def _watch(group: Any, work: Any) -> None:
    """Run `work`, failing fast if one of the processes dies meanwhile (`group`, where this
    process started them). Stopped (Ctrl-C), `work` is cancelled first and waited for a
    moment, while its client's writer still runs: the client ends its request as on any
    abandon, instead of dropping the abort (asyncio.run cancels every task at once)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            try:
                if group is not None:
                    group.check_alive()
            except OmniError:
                await cancel_and_wait([task])
                raise
            await asyncio.wait({task}, timeout=0.2)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task}, timeout=CLIENT_CLOSE_S)
        raise
    task.result()


def cmd_bench(args: argparse.Namespace) -> int:
    from omni_runtime.client.loadgen import run_load

    pipeline = _pipeline(args)
    hears = pipeline.outputs is not None and pipeline.outputs.input == "audio"
    given = args.prompt is not None or args.prompt_file is not None
    prompt = read_input(pipeline, args.prompt if given or hears else "hi there", args.prompt_file)
    result = asyncio.run(
        run_load(settings_of(args), pipeline, args.requests, args.concurrency, prompt)
    )
    print(result)
    return 0 if result.ok else 1


def cmd_serve(args: argparse.Namespace, children: Children) -> int:
    try:
        from omni_runtime.http.serve import run_serve
    except ImportError as e:
        raise ConfigError(
            f"serve needs the serve extra: pip install 'omni-runtime[serve]' ({e})"
        ) from None
    code = run_serve(args, settings_of(args), children, logging_args(args))
    exit_now(code)  # stopped and closed: no teardown to wait for


def cmd_status(args: argparse.Namespace) -> int:
    from omni_runtime.ops.status import run_status

    return run_status(args, settings_of(args))


def cmd_dead_letters(args: argparse.Namespace) -> int:
    from omni_runtime.ops.dead_letters import run_dead_letters

    return run_dead_letters(args, settings_of(args))


def cmd_trace(args: argparse.Namespace) -> int:
    from omni_runtime.ops.trace_view import run_trace

    return run_trace(args, settings_of(args))
