"""compose.yaml and the Dockerfile: "compose.yaml runs Redis + orchestrator + workers" (SPEC §5).

No Docker engine runs here, so the files are checked statically: each project service's command,
after Compose's `${VAR:-default}` interpolation, is one the `omni-runtime` parser accepts and names
a pipeline file that loads; the workers cover every stage exactly once; every process points at
the one Redis service; and the image installs the project with the repository as its workdir.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from omni_runtime.cli import build_parser
from omni_runtime.http.settings import ServeSettings
from omni_runtime.pipeline import PipelineConfig, load_pipeline
from omni_runtime.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROJECT_IMAGE = "omni-runtime"
REDIS_PORT = 6379
ENV_PREFIX = "OMNI_"

# Environments the stack must work under: all defaults, and the documented overrides.
ENVIRONMENTS = {
    "defaults": {},
    "streaming": {"PIPELINE_MODE": "streaming"},
    "scaled": {
        "THINKER_REPLICAS": "2",
        "TALKER_REPLICAS": "3",
        "CODE2WAV_REPLICAS": "4",
        "ORCHESTRATOR_REPLICAS": "2",
    },
}


# --- helpers ------------------------------------------------------------------------------

_INTERPOLATION = re.compile(
    r"\$(?:"
    r"(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-+?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<invalid>)"
    r")"
)


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable syntax: `$$`, `$VAR`, `${VAR}`, `${VAR[:]-default}`, `${VAR[:]+alt}`,
    `${VAR[:]?error}`. With a colon an empty value counts as unset. Anything else is an error."""

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"] is not None:
            return "$"
        if match["invalid"] is not None:
            raise ValueError(f"invalid interpolation at {match.start()} in {text!r}")
        name = match["braced"] or match["bare"]
        op, arg = match["op"] or "", match["arg"] or ""
        is_set = name in env and (env[name] != "" or not op.startswith(":"))
        if op.endswith("-"):
            return env[name] if is_set else arg
        if op.endswith("+"):
            return arg if is_set else ""
        if op.endswith("?") and not is_set:
            raise ValueError(f"required variable {name} is missing: {arg}")
        return env.get(name, "")

    return _INTERPOLATION.sub(substitute, text)


def interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    return node


def raw_compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict), "compose.yaml is a mapping"
    return loaded


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml as Compose sees it under `env` (an empty env: every default applies)."""
    return dict(interpolate_tree(raw_compose(), env or {}))


def services(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def is_project_service(service: Mapping[str, Any]) -> bool:
    return "build" in service or str(service.get("image", "")).startswith(PROJECT_IMAGE)


def project_services(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in services(compose).items() if is_project_service(svc)}


CONTAINER_HOSTNAME = "3f2a9c1b7d4e"
"""What Docker sets `$HOSTNAME` to in a container (its id), which a restart keeps."""


def argv_of(service: Mapping[str, Any]) -> list[str]:
    """The command's words; one run through `sh -c` (to read the container's `$HOSTNAME`)
    must `exec` it, so the stop signal reaches omni-runtime, not the shell."""
    command = service.get("command")
    assert command, "a project service states its command (the image's default is --help)"
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if argv[:2] != ["sh", "-c"]:
        return argv
    assert len(argv) == 3, f"one script, no arguments after it: {argv}"
    words = shlex.split(argv[2].replace("$HOSTNAME", CONTAINER_HOSTNAME))
    assert words[:1] == ["exec"], f"the shell must exec omni-runtime: {argv[2]}"
    return words[1:]


@functools.cache
def parser() -> argparse.ArgumentParser:
    """`omni-runtime`'s parser, built once: building it reads every setting (0.15 s)."""
    return build_parser()


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """What `omni-runtime` would do with `argv`, failing the test instead of exiting."""
    assert argv[:1] == ["omni-runtime"], f"command must start with omni-runtime: {argv}"
    try:
        return parser().parse_args(argv[1:])
    except SystemExit as e:
        pytest.fail(f"omni-runtime rejects {shlex.join(argv)} (exit {e.code})")


def cli_args(compose: Mapping[str, Any]) -> dict[str, argparse.Namespace]:
    return {name: parse_cli(argv_of(svc)) for name, svc in project_services(compose).items()}


def pipeline_path(args: argparse.Namespace) -> str:
    """The pipeline file a command names (`serve` takes a list: its first, here its only)."""
    given = args.pipeline
    return str(given[0] if isinstance(given, list) else given)


def pipeline_of(args: argparse.Namespace) -> PipelineConfig:
    return load_pipeline(ROOT / pipeline_path(args), mode=vars(args).get("mode"))


def long_running(compose: Mapping[str, Any]) -> dict[str, argparse.Namespace]:
    """The orchestrator and the workers: the processes `docker compose up` keeps running."""
    return {
        name: args
        for name, args in cli_args(compose).items()
        if args.command in ("orchestrator", "worker")
    }


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    instructions = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, arguments = line.partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
    return instructions


def shell_commands(run_arguments: str) -> list[list[str]]:
    """A RUN line's commands, split at `&&` and `;`."""
    commands: list[list[str]] = [[]]
    for token in shlex.split(run_arguments):
        if token in ("&&", ";"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


# --- the interpolation helper itself ------------------------------------------------------


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d}", env) == "x d d "
    assert interpolate("${SET:+alt}|${EMPTY:+alt}|${EMPTY+alt}|$SET|${UNSET}|$$SET", env) == (
        "alt||alt|x||$SET"
    )
    with pytest.raises(ValueError, match="UNSET"):
        interpolate("${UNSET:?needed}", env)
    with pytest.raises(ValueError, match="invalid interpolation"):
        interpolate("cost $5", env)


# --- commands -----------------------------------------------------------------------------


@pytest.mark.parametrize("env", ENVIRONMENTS.values(), ids=ENVIRONMENTS.keys())
def test_every_project_service_runs_an_omni_runtime_command_the_cli_accepts(
    env: dict[str, str],
) -> None:
    compose = load_compose(env)
    assert project_services(compose), "compose.yaml runs the project image"
    for name, args in cli_args(compose).items():
        assert args.func is not None, name


@pytest.mark.parametrize("env", ENVIRONMENTS.values(), ids=ENVIRONMENTS.keys())
def test_every_referenced_pipeline_file_exists_and_loads(env: dict[str, str]) -> None:
    for name, args in cli_args(load_compose(env)).items():
        path = pipeline_path(args)
        assert not Path(path).is_absolute(), f"{name}: paths are relative to the repo"
        assert (ROOT / path).is_file(), f"{name}: no pipeline file {path}"
        pipeline = pipeline_of(args)
        if vars(args).get("mode") is not None:
            assert pipeline.mode == args.mode


def test_there_is_one_orchestrator_service_scaled_by_orchestrator_replicas() -> None:
    compose = load_compose(ENVIRONMENTS["scaled"])
    orchestrators = [n for n, a in cli_args(compose).items() if a.command == "orchestrator"]
    assert len(orchestrators) == 1, orchestrators
    deploy = services(compose)[orchestrators[0]].get("deploy", {})
    assert int(deploy.get("replicas", 1)) == 2
    assert int(services(load_compose())[orchestrators[0]]["deploy"]["replicas"]) == 1


def test_there_is_exactly_one_worker_service_per_stage_named_after_it() -> None:
    compose = load_compose()
    workers: dict[str, dict[int, str]] = {}
    for name, args in cli_args(compose).items():
        if args.command == "worker":
            stage_to_service = workers.setdefault(args.pipeline, {})
            assert args.stage not in stage_to_service, (
                f"stage {args.stage} of {args.pipeline}: {stage_to_service[args.stage]} and {name}"
            )
            stage_to_service[args.stage] = name
    orchestrated = {a.pipeline for a in cli_args(compose).values() if a.command == "orchestrator"}
    assert set(workers) == orchestrated, "workers run exactly the orchestrator's pipeline"
    for pipeline_path, stage_to_service in workers.items():
        pipeline = load_pipeline(ROOT / pipeline_path)
        assert sorted(stage_to_service) == list(range(pipeline.last_stage + 1)), pipeline_path
        for stage_id, service_name in stage_to_service.items():
            assert service_name == pipeline.stage(stage_id).name


def test_worker_replicas_are_set_from_the_environment() -> None:
    raw = services(raw_compose())
    worker_names = [n for n, a in cli_args(load_compose()).items() if a.command == "worker"]
    for name in worker_names:
        template = str(raw[name]["deploy"]["replicas"])
        match = re.fullmatch(r"\$\{(?P<var>[A-Z0-9_]+_REPLICAS):-(?P<default>\d+)\}", template)
        assert match, f"{name}: deploy.replicas should be ${{<STAGE>_REPLICAS:-1}}, is {template}"
        assert int(interpolate(template, {})) == int(match["default"]) >= 1
        assert int(interpolate(template, {match["var"]: "3"})) == 3


def test_all_processes_agree_on_pipeline_mode_and_namespace() -> None:
    for env in ENVIRONMENTS.values():
        compose = load_compose(env)
        stack = long_running(compose)
        assert {(a.pipeline, vars(a).get("mode")) for a in stack.values()} == {
            ("workers/omni.yaml", env.get("PIPELINE_MODE", "sequential"))
        }
        for name, svc in project_services(compose).items():
            assert svc["environment"]["OMNI_NAMESPACE"] == "omni", name
            assert "namespace" not in vars(cli_args(compose)[name]), (
                f"{name}: --namespace overrides"
            )
    custom = load_compose({"OMNI_NAMESPACE": "demo"})
    assert {s["environment"]["OMNI_NAMESPACE"] for s in project_services(custom).values()} == {
        "demo"
    }


# --- Redis --------------------------------------------------------------------------------


def test_every_project_service_sets_omni_redis_url_to_the_redis_service() -> None:
    compose = load_compose()
    all_services = services(compose)
    for name, svc in project_services(compose).items():
        url = urlsplit(svc["environment"]["OMNI_REDIS_URL"])
        assert url.scheme in ("redis", "rediss"), name
        assert url.hostname in all_services, f"{name}: {url.hostname} is not a service"
        assert str(all_services[url.hostname]["image"]).startswith("redis:"), name
        assert (url.port or REDIS_PORT) == REDIS_PORT, name
        assert "redis_url" not in vars(cli_args(compose)[name]), f"{name}: --redis-url overrides it"


def test_every_omni_variable_is_a_valid_setting() -> None:
    for name, svc in project_services(load_compose()).items():
        fields = {
            key.removeprefix(ENV_PREFIX).lower(): value
            for key, value in svc["environment"].items()
            if key.startswith(ENV_PREFIX)
        }
        serve_only = set(ServeSettings.model_fields) if name == "serve" else set()
        unknown = set(fields) - set(Settings.model_fields) - serve_only
        assert not unknown, f"{name}: no such setting {unknown}"
        Settings(**{k: v for k, v in fields.items() if k not in serve_only})


def test_project_services_wait_for_a_healthy_redis() -> None:
    compose = load_compose()
    redis = services(compose)["redis"]
    assert redis["image"].startswith("redis:7")
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    for name, svc in project_services(compose).items():
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name


def test_redis_keeps_no_data_on_disk() -> None:
    command = argv_of(services(load_compose())["redis"])
    assert command[0] == "redis-server"
    assert command[command.index("--save") + 1] == ""
    assert command[command.index("--appendonly") + 1] == "no"


# --- lifecycle ----------------------------------------------------------------------------


def test_orchestrator_and_workers_restart_unless_stopped_with_a_stop_grace_period() -> None:
    compose = load_compose()
    for name in long_running(compose):
        svc = services(compose)[name]
        assert svc["restart"] == "unless-stopped", name
        assert re.fullmatch(r"([1-9]\d*(ms|s|m|h))+", str(svc["stop_grace_period"])), name


def test_documented_run_examples_name_real_services_and_valid_commands() -> None:
    compose = load_compose()
    examples = [
        shlex.split(line.lstrip("#"), comments=True)
        for line in COMPOSE.read_text(encoding="utf-8").splitlines()
        if line.startswith("#") and "docker compose run" in line
    ]
    assert any("submit" in example for example in examples), "a submit example is documented"
    for example in examples:
        rest = example[example.index("run") + 1 :]
        while rest and rest[0].startswith("-"):
            rest = rest[1:]
        service, argv = rest[0], rest[1:]
        assert service in project_services(compose), f"no project service {service}"
        if argv:
            args = parse_cli(argv)
            pipeline_of(args)


# --- image --------------------------------------------------------------------------------


def test_dockerfile_builds_on_python_311_slim_and_installs_the_project() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0][0] == "FROM"
    assert instructions[0][1].startswith("python:3.11-slim")
    installs = [
        command
        for keyword, arguments in instructions
        if keyword == "RUN"
        for command in shell_commands(arguments)
        if command[:2] == ["pip", "install"] or command[:4] == ["python", "-m", "pip", "install"]
    ]
    assert any(
        any(arg == "." or arg.startswith(".[") for arg in command) and "--no-cache-dir" in command
        for command in installs
    ), installs


def test_image_workdir_is_the_repo_root_so_relative_pipeline_paths_resolve() -> None:
    instructions = dockerfile_instructions()
    workdir = [arguments for keyword, arguments in instructions if keyword == "WORKDIR"][-1]
    copies = [arguments.split() for keyword, arguments in instructions if keyword == "COPY"]
    assert any(c[0] == "." and c[-1] in (".", workdir, workdir + "/") for c in copies), copies
    for name, svc in project_services(load_compose()).items():
        assert svc.get("working_dir", workdir) == workdir, name


def test_image_runs_as_a_non_root_user_and_shows_help_by_default() -> None:
    instructions = dockerfile_instructions()
    users = [arguments for keyword, arguments in instructions if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    cmd = json.loads([arguments for keyword, arguments in instructions if keyword == "CMD"][-1])
    assert cmd == ["omni-runtime", "--help"]
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(cmd[1:])
    assert exited.value.code == 0


def test_dockerignore_keeps_what_pip_install_needs() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for needed in ("pyproject.toml", "omni_runtime", "workers"):
        assert not any(Path(needed).match(p) for p in patterns), needed
    assert ".git" in patterns


def test_orchestrators_and_workers_are_named_after_their_container() -> None:
    """`restart: unless-stopped` starts a container again in place, with its hostname: a
    worker then resumes its own backlog, an orchestrator gives its previous life's slots
    up at once (`docs/deploy.md`)."""
    for name, args in long_running(load_compose()).items():
        if args.command == "worker":
            assert args.worker_id == CONTAINER_HOSTNAME and args.replaces is None, name
        else:
            assert args.orchestrator_id == args.replaces == CONTAINER_HOSTNAME, name
