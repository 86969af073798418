"""`omni-runtime`: parse arguments into typed settings and call the library. Nothing else."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from redis.exceptions import RedisError

from omni_runtime.core.types import OrchOutput
from omni_runtime.errors import OmniError
from omni_runtime.pipeline import PipelineConfig, load_pipeline
from omni_runtime.settings import Settings

log = logging.getLogger("omni_runtime")


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    if args.redis_url:
        overrides["redis_url"] = args.redis_url
    if args.namespace:
        overrides["namespace"] = args.namespace
    return Settings(**overrides)


def _pipeline(args: argparse.Namespace) -> PipelineConfig:
    return load_pipeline(args.pipeline, mode=getattr(args, "mode", None))


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

    worker = StageWorker(_pipeline(args), args.stage, _settings(args), worker_id=args.worker_id)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    worker.run()
    stuck = [
        t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()
    ]
    if stuck:  # stage code that ignores aborts must not keep a stopped worker alive
        log.warning("exiting with stage code still running on %s", ", ".join(stuck))
        logging.shutdown()
        os._exit(0)
    return 0


# --- clients ------------------------------------------------------------------


class OutputPrinter:
    """Prints outputs as they stream; keeps audio chunks for `--wav`."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.audio: list[Any] = []
        self.failed = False
        self.started = time.monotonic()

    def __call__(self, out: OrchOutput) -> None:
        elapsed_ms = (time.monotonic() - self.started) * 1000
        if out.error is not None:
            self.failed = True
            print(
                f"[{elapsed_ms:7.1f} ms] stage {out.stage_id} ERROR: {out.error}", file=sys.stderr
            )
            return
        data = out.data
        if hasattr(data, "dtype") and hasattr(data, "shape"):
            self.audio.append(data)
            desc = f"audio chunk {data.shape[0]} samples ({data.dtype})"
        else:
            desc = repr(data)
        if not self.quiet:
            end = "  (finished)" if out.finished else ""
            print(f"[{elapsed_ms:7.1f} ms] stage {out.stage_id}: {desc}{end}", flush=True)


def _write_wav(printer: OutputPrinter, path: str | None, pipeline: PipelineConfig) -> None:
    if path is None:
        return
    from omni_runtime.wav import write_wav

    rate = next(
        (int(s.options["sample_rate"]) for s in pipeline.stages if "sample_rate" in s.options),
        16000,
    )
    frames = write_wav(path, printer.audio, rate)
    print(f"wrote {path}: {frames} frames, {frames / rate:.2f} s at {rate} Hz")


async def _submit_and_print(
    settings: Settings, prompt: str, printer: OutputPrinter, stage_ids: list[int]
) -> None:
    from omni_runtime.client import OmniClient

    async with OmniClient(settings) as client:
        await client.wait_ready(stage_ids)
        printer.started = time.monotonic()
        async for out in client.generate(prompt):
            printer(out)


def cmd_submit(args: argparse.Namespace) -> int:
    pipeline = _pipeline(args)
    printer = OutputPrinter()
    stage_ids = list(range(pipeline.last_stage + 1))
    asyncio.run(_submit_and_print(_settings(args), args.prompt, printer, stage_ids))
    _write_wav(printer, args.wav, pipeline)
    return 1 if printer.failed else 0


def cmd_run(args: argparse.Namespace) -> int:
    from omni_runtime.launcher import ProcessGroup, child_env, local_redis

    pipeline = _pipeline(args)
    settings = _settings(args)
    printer = OutputPrinter()
    with local_redis(settings.redis_url, settings.startup_timeout_s) as (url, how):
        print(f"pipeline {pipeline.name!r} ({pipeline.mode} mode) on {how}", flush=True)
        env = child_env(url, {"OMNI_NAMESPACE": settings.namespace})
        group = ProcessGroup(Path(args.pipeline), pipeline, env)
        group.start()
        try:
            run_settings = settings.model_copy(update={"redis_url": url})
            stage_ids = list(range(pipeline.last_stage + 1))
            asyncio.run(
                _watch(group, _submit_and_print(run_settings, args.prompt, printer, stage_ids))
            )
        finally:
            group.stop()
    _write_wav(printer, args.wav, pipeline)
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
    return 0


# --- parser -------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-runtime", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str, *, prompt: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--pipeline", required=True, help="pipeline YAML file")
        p.add_argument(
            "--mode", choices=["sequential", "streaming"], help="override the file's mode"
        )
        p.add_argument("--redis-url", help="overrides OMNI_REDIS_URL (redis:// or rediss://)")
        p.add_argument("--namespace", help="overrides OMNI_NAMESPACE")
        if prompt:
            p.add_argument("prompt", help="the request's prompt")
            p.add_argument("--wav", help="write the audio outputs to this .wav file")
        return p

    add("orchestrator", "run the orchestrator process").set_defaults(func=cmd_orchestrator)
    w = add("worker", "run one stage worker process")
    w.add_argument("--stage", type=int, required=True, help="stage id")
    w.add_argument("--worker-id", help="consumer name (default: host-pid-random)")
    w.set_defaults(func=cmd_worker)
    add(
        "submit", "submit a prompt to a running pipeline and stream its outputs", prompt=True
    ).set_defaults(func=cmd_submit)
    add(
        "run",
        "run the whole pipeline locally for one prompt (starts Redis if none is given)",
        prompt=True,
    ).set_defaults(func=cmd_run)
    b = add("bench", "load a running pipeline: requests/s and latency")
    b.add_argument("-n", "--requests", type=int, default=1000)
    b.add_argument("-c", "--concurrency", type=int, default=64)
    b.add_argument("--prompt", default="hi there")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args))
    except (OmniError, ValidationError) as e:
        print(f"omni-runtime: error: {e}", file=sys.stderr)
        return 2
    except RedisError as e:
        print(
            f"omni-runtime: error: Redis: {e} (check OMNI_REDIS_URL / --redis-url)", file=sys.stderr
        )
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
