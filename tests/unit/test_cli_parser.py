"""The command line builds the settings flags of the subcommand it runs, and only those."""

from __future__ import annotations

import argparse

import pytest

from omni_runtime.cli import COMMANDS, build_parser, parse_args
from omni_runtime.cli.commands import settings_of


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def test_commands_names_every_subcommand() -> None:
    assert sorted(subcommands(build_parser())) == sorted(COMMANDS)


def test_only_the_named_subcommand_gets_the_settings_flags() -> None:
    built = subcommands(build_parser("worker"))
    assert built["worker"].get_default("settings_source") is not None
    assert all(p.get_default("settings_source") is None for n, p in built.items() if n != "worker")


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--pipeline", "p.yaml", "--stage", "1", "--block-ms", "50"],
        ["-v", "worker", "--pipeline", "p.yaml", "--stage", "1", "--block-ms", "50"],
        # a flag's value that names another command: parsed as argparse reads it
        [
            "--settings-file",
            "run",
            "worker",
            "--pipeline",
            "p.yaml",
            "--stage",
            "1",
            "--block-ms",
            "50",
        ],
    ],
)
def test_settings_come_from_the_subcommand_given(argv: list[str]) -> None:
    args = parse_args(argv)
    assert args.command == "worker"
    assert args.stage == 1
    assert settings_of(argparse.Namespace(**{**vars(args), "settings_file": None})).block_ms == 50
