"""The `serve` subcommand's own flags: declared without importing the web stack."""

from __future__ import annotations

import argparse


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve-only flags; `--mode`, `--redis-url`, `--namespace` come from the CLI's
    common ones. API keys come only from OMNI_API_KEYS (argv is visible in `ps`)."""
    parser.add_argument(
        "--pipeline",
        required=True,
        action="append",
        help="pipeline YAML file; repeat it (or give a comma list) to serve several, "
        "each a `model` of its name, each in namespace <namespace>.<name>",
    )
    parser.add_argument("--host", help="address to bind (default 127.0.0.1; env OMNI_HOST)")
    parser.add_argument("--port", type=int, help="port (default 8000; env OMNI_PORT)")
    parser.add_argument("--max-inflight", type=int, help="requests at once before 429 (default 64)")
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=None,
        help="allow a non-loopback --host without OMNI_API_KEYS",
    )
