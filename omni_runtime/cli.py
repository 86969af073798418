"""`omni-runtime`: parse arguments into typed settings and call the library. Nothing else."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from pydantic_settings import CliSettingsSource
from redis.exceptions import RedisError

from omni_runtime import __version__
from omni_runtime.console import OutputPrinter, check_wav_path, read_prompt, write_wav
from omni_runtime.errors import ConfigError, OmniError
from omni_runtime.logs import configure_logging
from omni_runtime.pipeline import PipelineConfig, check_stage_options, load_pipeline
from omni_runtime.settings import Settings

DESCRIPTION = """\
Serve multi-stage model pipelines (thinker -> talker -> vocoder), every stage its own
process, all over Redis. `run` does everything locally for one prompt; in production
start `orchestrator` and `worker`s (any hosts), then `submit` or `bench`.
Every OMNI_* setting is also a flag (--redis-url, --deadline-s, ...) and may come
from a YAML file (--settings-file)."""


def _settings(args: argparse.Namespace) -> Settings:
    source: CliSettingsSource[Settings] = args.settings_source
    return Settings.load(source(parsed_args=args), args.settings_file)


def _pipeline(args: argparse.Namespace) -> PipelineConfig:
    return load_pipeline(args.pipeline, mode=getattr(args, "mode", None))


def _wav_rate(pipeline: PipelineConfig) -> int:
    """The audio's sample rate as the pipeline file states it (`outputs.sample_rate`)."""
    return pipeline.outputs.sample_rate if pipeline.outputs is not None else 16000


# --- long-running processes ---------------------------------------------------


def cmd_orchestrator(args: argparse.Namespace) -> int:
    from omni_runtime.orchestrator_proc import OrchestratorService

    service = OrchestratorService(_pipeline(args), _settings(args))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await service.run(stop)

    asyncio.run(main())
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from omni_runtime.worker.proc import StageWorker

    pipeline = _pipeline(args)
    check_stage_options(pipeline, [args.stage])
    worker = StageWorker(pipeline, args.stage, _settings(args), worker_id=args.worker_id)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    worker.run()
    stuck = [
        t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()
    ]
    if stuck:  # stage code that ignores aborts must not keep a stopped worker alive
        logging.getLogger(__name__).warning(
            "exiting with stage code still running on %s", ", ".join(stuck)
        )
        logging.shutdown()
        os._exit(0)
    return 0


# --- clients ------------------------------------------------------------------


async def _submit_and_print(
    settings: Settings, prompt: str, printer: OutputPrinter, stage_ids: list[int]
) -> None:
    from omni_runtime.client import OmniClient

    async with OmniClient(settings) as client:
        await client.wait_ready(stage_ids)
        printer.restart_clock()
        async for out in client.generate(prompt):
            printer(out)


def cmd_submit(args: argparse.Namespace) -> int:
    pipeline = _pipeline(args)
    prompt = read_prompt(args.prompt, args.prompt_file)
    check_wav_path(args.wav)
    printer = OutputPrinter()
    stage_ids = list(range(pipeline.last_stage + 1))
    asyncio.run(_submit_and_print(_settings(args), prompt, printer, stage_ids))
    write_wav(printer, args.wav, _wav_rate(pipeline))
    return 1 if printer.failed else 0


def cmd_run(args: argparse.Namespace) -> int:
    from omni_runtime.launcher import ProcessGroup, child_env, local_redis

    pipeline = _pipeline(args)
    settings = _settings(args)
    prompt = read_prompt(args.prompt, args.prompt_file)
    check_wav_path(args.wav)
    check_stage_options(pipeline, range(pipeline.last_stage + 1))
    printer = OutputPrinter()
    with local_redis(settings.redis_url, settings.startup_timeout_s) as (url, how):
        print(f"pipeline {pipeline.name!r} ({pipeline.mode} mode) on {how}", flush=True)
        env = child_env(url, {"OMNI_NAMESPACE": settings.namespace})
        group = ProcessGroup(Path(args.pipeline), pipeline, env)
        group.start()
        try:
            run_settings = settings.model_copy(update={"redis_url": url})
            stage_ids = list(range(pipeline.last_stage + 1))
            asyncio.run(_watch(group, _submit_and_print(run_settings, prompt, printer, stage_ids)))
        finally:
            group.stop()
    write_wav(printer, args.wav, _wav_rate(pipeline))
    print(printer.summary())
    return 1 if printer.failed else 0


async def _watch(group: Any, work: Any) -> None:
    """Run `work`, failing fast if one of the processes dies meanwhile."""
    task = asyncio.ensure_future(work)
    while not task.done():
        try:
            group.check_alive()
        except OmniError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        await asyncio.wait({task}, timeout=0.2)
    task.result()


def cmd_bench(args: argparse.Namespace) -> int:
    from omni_runtime.loadgen import run_load

    report = asyncio.run(
        run_load(_settings(args), _pipeline(args), args.requests, args.concurrency, args.prompt)
    )
    print(report)
    return 1 if " 0 errors" not in report else 0


def serve_flags(parser: argparse.ArgumentParser) -> None:
    try:
        from omni_runtime.http.serve import add_serve_arguments
    except ImportError:  # the `serve` extra is not installed: `serve` says so when run
        return
    add_serve_arguments(parser)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from omni_runtime.http.serve import run_serve
    except ImportError as e:
        raise ConfigError(
            f"serve needs the serve extra: pip install 'omni-runtime[serve]' ({e})"
        ) from None
    return run_serve(args, _settings(args))


# --- parser -------------------------------------------------------------------


def _logging_flags(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """Accepted before and after the subcommand (subcommands do not reset what was given)."""
    d = (lambda value: value) if defaults else (lambda _value: argparse.SUPPRESS)
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=d(False), help="debug logging"
    )
    parser.add_argument("--log-level", default=d("INFO"), help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=d("text"),
        help="json: one object per line",
    )
    parser.add_argument(
        "--settings-file",
        default=d(os.environ.get("OMNI_SETTINGS_FILE")),
        help="YAML file of settings (lowest priority after defaults)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-runtime", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"omni-runtime {__version__}")
    _logging_flags(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, help_text: str, *, prompt: bool = False, mode: bool = True
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        _logging_flags(p, defaults=False)
        p.add_argument("--pipeline", required=True, help="pipeline YAML file")
        if mode:
            p.add_argument(
                "--mode", choices=["sequential", "streaming"], help="override the file's mode"
            )
        if prompt:
            p.add_argument("prompt", nargs="?", help="the request's prompt ('-': read stdin)")
            p.add_argument("--prompt-file", help="read the prompt from this file ('-': stdin)")
            p.add_argument("--wav", help="write the audio outputs to this .wav file")
        source: CliSettingsSource[Settings] = CliSettingsSource(
            Settings, root_parser=p, cli_kebab_case=True, cli_hide_none_type=True
        )
        p.set_defaults(settings_source=source)
        return p

    add("orchestrator", "run the orchestrator process").set_defaults(func=cmd_orchestrator)
    w = add("worker", "run one stage worker process")
    w.add_argument("--stage", type=int, required=True, help="stage id")
    w.add_argument("--worker-id", help="consumer name (default: host-pid-random)")
    w.set_defaults(func=cmd_worker)
    # a running deployment's mode is its orchestrator's and workers': submit and bench follow it
    add(
        "submit",
        "submit a prompt to a running pipeline and stream its outputs",
        prompt=True,
        mode=False,
    ).set_defaults(func=cmd_submit)
    add(
        "run",
        "run the whole pipeline locally for one prompt (starts Redis if none is given)",
        prompt=True,
    ).set_defaults(func=cmd_run)
    serve = add(
        "serve",
        "serve the pipeline over HTTP, OpenAI-compatible, with a playground page at / "
        "(starts Redis, the orchestrator and workers if no Redis URL is given)",
    )
    serve_flags(serve)
    serve.set_defaults(func=cmd_serve)
    b = add("bench", "load a running pipeline: requests/s and latency", mode=False)
    b.add_argument("-n", "--requests", type=int, default=1000, help="requests to send in all")
    b.add_argument("-c", "--concurrency", type=int, default=64, help="requests in flight at once")
    b.add_argument("--prompt", default="hi there", help="the prompt of every request")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("DEBUG" if args.verbose else args.log_level, args.log_format)
    try:
        return int(args.func(args))
    except OmniError as e:
        print(f"omni-runtime: error: {e}", file=sys.stderr)
        return 2
    except TimeoutError as e:  # the client's request timeout: a message, not a traceback
        print(
            f"omni-runtime: error: {e or 'timed out'} (raise OMNI_REQUEST_TIMEOUT_S)",
            file=sys.stderr,
        )
        return 2
    except RedisError as e:
        print(
            f"omni-runtime: error: Redis: {e} (check OMNI_REDIS_URL / --redis-url)", file=sys.stderr
        )
        return 2
    except BrokenPipeError:  # `submit ... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
