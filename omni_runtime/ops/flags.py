"""The flags of the operator commands, apart from the commands: every process builds the
whole parser, and none should import rich (or Redis) for that."""

from __future__ import annotations

import argparse


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")


def add_dead_letters_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replay", metavar="ID", help="re-queue this dead letter onto its stream")
    parser.add_argument("--force", action="store_true", help="replay even a payload cut at 4 KiB")
    parser.add_argument("--limit", type=int, default=100, help="list at most this many (newest)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id", help="the request's id (as `submit -v` logs it)")
    parser.add_argument("--png", metavar="FILE", help="also draw the timeline into this PNG file")
    parser.add_argument("--json", action="store_true", help="print the stamps as JSON")
    parser.add_argument(
        "--otel", action="store_true", help="send it to OTEL_EXPORTER_OTLP_ENDPOINT as spans"
    )
