"""`omni-runtime`: parse arguments into typed settings and call the library. Nothing else.

The subcommands themselves are in `commands`, what they print in `console`."""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys

from pydantic_settings import CliSettingsSource

from omni_runtime import __version__
from omni_runtime.cli.commands import (
    cmd_bench,
    cmd_dead_letters,
    cmd_orchestrator,
    cmd_run,
    cmd_serve,
    cmd_status,
    cmd_submit,
    cmd_trace,
    cmd_worker,
)
from omni_runtime.cli.startup import document_fields, import_redis
from omni_runtime.errors import OmniError
from omni_runtime.local.forked import Children
from omni_runtime.logs import configure_logging
from omni_runtime.settings import Settings

DESCRIPTION = """\
Serve multi-stage model pipelines (thinker -> talker -> vocoder), every stage its own
process, all over Redis. `run` does everything locally for one prompt; in production
start `orchestrator` and `worker`s (any hosts), then `submit` or `bench`.
Every OMNI_* setting is also a flag (--redis-url, --deadline-s, ...) and may come
from a YAML file (--settings-file)."""


def process_id(text: str) -> str:
    """A process's name in Redis keys and connection names: no separator, no space."""
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: 1 to 128 letters, digits, '.', '_' or '-'")
    return text


def serve_flags(parser: argparse.ArgumentParser) -> None:
    from omni_runtime.http.flags import add_serve_arguments

    add_serve_arguments(parser)


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


COMMANDS = (
    "orchestrator",
    "worker",
    "submit",
    "run",
    "serve",
    "bench",
    "status",
    "dead-letters",
    "trace",
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only`, the settings flags of that subcommand alone
    (each subcommand's ~40 settings flags take ~10 ms to build: a process runs one)."""
    parser = argparse.ArgumentParser(prog="omni-runtime", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"omni-runtime {__version__}")
    _logging_flags(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str,
        help_text: str,
        *,
        prompt: bool = False,
        mode: bool = True,
        pipeline: bool = True,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        _logging_flags(p, defaults=False)
        if pipeline:
            p.add_argument("--pipeline", required=True, help="pipeline YAML file")
        if mode:
            p.add_argument(
                "--mode", choices=["sequential", "streaming"], help="override the file's mode"
            )
        if prompt:
            p.add_argument("prompt", nargs="?", help="the request's prompt ('-': read stdin)")
            p.add_argument(
                "--prompt-file",
                help="read the prompt from this file ('-': stdin); a recording (WAV, MP3, "
                "FLAC, Ogg) for a pipeline that takes speech",
            )
            p.add_argument("--wav", help="write the audio outputs to this .wav file")
            p.add_argument(
                "--param", action="append", default=[], metavar="KEY=VALUE",
                help="a request parameter for the stages (repeatable): max_tokens=40, "
                "temperature=0.2, seed=7, voice=joe, speed=1.2; a JSON value, else a string",
            )  # fmt: skip
        if only is not None and name != only:
            return p
        document_fields(Settings)
        source: CliSettingsSource[Settings] = CliSettingsSource(
            Settings,
            root_parser=p,
            cli_kebab_case=True,
            cli_hide_none_type=True,
            cli_implicit_flags=True,
        )
        p.set_defaults(settings_source=source)
        return p

    o = add("orchestrator", "run the orchestrator process")
    o.add_argument(
        "--orchestrator-id", type=process_id, help="its name in the leases (default: random)"
    )
    o.add_argument(
        "--replaces",
        type=process_id,
        metavar="ORCHESTRATOR_ID",
        help="the id of an orchestrator process that has exited: its slots are taken at "
        "once, not once their leases lapsed (what `serve` gives the process it starts in a "
        "dead one's place; never a live process's id)",
    )
    o.set_defaults(func=cmd_orchestrator)
    w = add("worker", "run one stage worker process")
    w.add_argument("--stage", type=int, required=True, help="stage id")
    w.add_argument("--worker-id", type=process_id, help="consumer name (default: host-pid-random)")
    w.add_argument(
        "--replaces",
        type=process_id,
        metavar="WORKER_ID",
        help="the consumer name of a worker of this stage whose process has exited: its "
        "inputs are taken over at once, not once its heartbeat expired (what `serve` gives "
        "the process it starts in a dead one's place; never a live worker's name)",
    )
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
    ).set_defaults(func=functools.partial(cmd_run, children=CHILDREN))
    serve = add(
        "serve",
        "serve the pipeline over HTTP, OpenAI-compatible, with a playground page at / "
        "(starts Redis, the orchestrator and workers if no Redis URL is given)",
        pipeline=False,  # its own --pipeline, given once per pipeline served (http/flags.py)
    )
    serve_flags(serve)
    serve.set_defaults(func=functools.partial(cmd_serve, children=CHILDREN))
    b = add("bench", "load a running pipeline: requests/s and latency", mode=False)
    b.add_argument("-n", "--requests", type=int, default=1000, help="requests to send in all")
    b.add_argument("-c", "--concurrency", type=int, default=64, help="requests in flight at once")
    b.add_argument("--prompt", help="the prompt of every request (default: 'hi there')")
    b.add_argument(
        "--prompt-file",
        help="read the prompt from this file ('-': stdin); a recording (WAV, MP3, FLAC, Ogg) "
        "for a pipeline that takes speech",
    )
    b.set_defaults(func=cmd_bench)
    from omni_runtime.ops.flags import (
        add_dead_letters_arguments,
        add_status_arguments,
        add_trace_arguments,
    )

    for name, help_text, add_flags, func in (
        (
            "status",
            "live view of processes, streams and dead letters",
            add_status_arguments,
            cmd_status,
        ),
        (
            "dead-letters",
            "list dead letters, or re-queue one",
            add_dead_letters_arguments,
            cmd_dead_letters,
        ),
        (
            "trace",
            "a request's timeline (OMNI_TRACE=1), as a table or a PNG",
            add_trace_arguments,
            cmd_trace,
        ),
    ):
        p = add(name, help_text, mode=False, pipeline=False)
        add_flags(p)
        p.set_defaults(func=func)
    return parser


def command_of(argv: list[str]) -> str | None:
    """The subcommand `argv` names, read as the full parser reads it (None: unsure)."""
    top = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    _logging_flags(top, defaults=True)
    top.add_argument("command", nargs="?")
    try:
        known, _rest = top.parse_known_args(argv)
    except argparse.ArgumentError:
        return None
    return known.command if known.command in COMMANDS else None


_PARSERS: dict[tuple[str | None, str | None], argparse.ArgumentParser] = {}


def parser_for(only: str | None) -> argparse.ArgumentParser:
    """`build_parser(only)`, built once per process (~15 ms each): `run` builds its
    children's before forking them (`forked.preload`), four processes then parse at once."""
    key = (only, os.environ.get("OMNI_SETTINGS_FILE"))  # the one default read from outside
    if key not in _PARSERS:
        _PARSERS[key] = build_parser(only)
    return _PARSERS[key]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Build the settings flags of the subcommand given only, then parse."""
    only = command_of(argv)
    args = parser_for(only).parse_args(argv)
    if only is not None and args.command != only:  # (cannot happen: a safety net)
        args = build_parser().parse_args(argv)
    return args


def _redis_errors() -> tuple[type[Exception], ...]:
    """redis-py's base error, once redis-py is imported (an `except` clause evaluates this
    only when an exception is being matched); before, none can be one: an empty tuple."""
    exceptions = sys.modules.get("redis.exceptions")
    return () if exceptions is None else (exceptions.RedisError,)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging("DEBUG" if args.verbose else args.log_level, args.log_format)
    if args.command != "run":  # `run` imports it once its redis-server is launched
        import_redis()
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
    except BrokenPipeError:  # `submit ... | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except _redis_errors() as e:  # redis-py is imported late (`run`): the class, once it is
        print(
            f"omni-runtime: error: Redis: {e} (check OMNI_REDIS_URL / --redis-url)", file=sys.stderr
        )
        return 2
    except KeyboardInterrupt:
        return 130


def _prepare_children() -> None:
    """Build the command lines the children parse, once, before they are forked."""
    import_redis()
    for command in ("orchestrator", "worker"):
        parser_for(command)


CHILDREN = Children(
    main=main,
    modules=(
        "numpy",  # the codec's arrays (the demo's stages use it too)
        "omni_runtime.orchestrator.proc",
        "omni_runtime.worker.proc",
    ),
    prepare=_prepare_children,
)
"""What `run` and `serve` fork: this command line, its processes' modules imported first."""


if __name__ == "__main__":
    sys.exit(main())
