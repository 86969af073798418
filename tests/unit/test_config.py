"""Pipeline files and settings: what loads, and errors that name the file and the field."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from omni_runtime.errors import ConfigError
from omni_runtime.pipeline import PipelineConfig, StageConfig, load_pipeline, resolve_entry
from omni_runtime.settings import Settings
from omni_runtime.stage_api import StageEngine, preloads
from omni_runtime.worker.engines import GeneratorEngine, load_engine

pytestmark = pytest.mark.timeout(30)

WORKERS = Path(__file__).resolve().parents[2] / "workers"
SEED = WORKERS / "seed.yaml"
OMNI = WORKERS / "omni.yaml"


@pytest.fixture(autouse=True)
def no_omni_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read `OMNI_*`: start every test from an environment without any."""
    for name in list(os.environ):
        if name.startswith("OMNI_"):
            monkeypatch.delenv(name)


@pytest.fixture
def keep_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """`resolve_entry` appends the pipeline's directory to sys.path: undo it afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))


# --- the bundled pipelines ----------------------------------------------------


@pytest.mark.parametrize("path", [SEED, OMNI], ids=["seed", "omni"])
def test_bundled_pipelines_load(path: Path, keep_sys_path: None) -> None:
    config = load_pipeline(path)
    assert isinstance(config, PipelineConfig)
    assert config.name == path.stem
    assert config.mode == ("sequential" if path == SEED else "streaming")
    assert config.final_stage_ids == [0, 2]
    assert config.last_stage == 2
    assert [s.id for s in config.stages] == [0, 1, 2]
    assert all(s.replicas == 1 for s in config.stages)
    assert config.source_dir == WORKERS
    for stage in config.stages:
        assert callable(resolve_entry(stage.entry, config.source_dir)), stage.entry


def test_bundled_pipelines_carry_their_options() -> None:
    seed = load_pipeline(SEED)
    assert [s.name for s in seed.stages] == ["split_words", "upper_all", "prefix_wav"]
    assert seed.stages[1].options == {"fail_word": None}
    omni = load_pipeline(str(OMNI))  # a str path works as well as a Path
    assert [s.name for s in omni.stages] == ["thinker", "talker", "code2wav"]
    assert omni.stages[2].options == {"sample_rate": 16000, "frame_ms": 20, "real_time_factor": 50}


@pytest.mark.parametrize("path", [SEED, OMNI], ids=["seed", "omni"])
@pytest.mark.parametrize("mode", ["streaming", "sequential"])
def test_mode_override(path: Path, mode: str) -> None:
    own = yaml.safe_load(path.read_text())["mode"]
    assert load_pipeline(path, mode=mode).mode == mode
    assert load_pipeline(path).mode == own  # the file itself is untouched
    assert load_pipeline(path, default_mode=mode).mode == own  # the file's mode wins


def test_the_demo_pipelines_stream_and_serve_streams_what_names_no_mode(tmp_path: Path) -> None:
    """The playground said audio plays as produced while the demo ran sequentially."""
    assert load_pipeline(OMNI).mode == "streaming"
    assert load_pipeline(OMNI.parent / "voice.yaml").mode == "streaming"
    bare = tmp_path / "bare.yaml"
    bare.write_text(
        "\n".join(line for line in SEED.read_text().splitlines() if line != "mode: sequential")
    )
    assert load_pipeline(bare).mode == "sequential"  # the file format's default
    assert load_pipeline(bare, default_mode="streaming").mode == "streaming"  # serve's


def test_bad_mode_override_names_the_file_and_the_field() -> None:
    with pytest.raises(ConfigError) as err:
        load_pipeline(SEED, mode="parallel")
    assert str(SEED) in str(err.value)
    assert "mode" in str(err.value)


def test_stage_lookup() -> None:
    config = load_pipeline(SEED)
    assert config.stage(1).name == "upper_all"
    with pytest.raises(ConfigError, match="no stage 3"):
        config.stage(3)


# --- errors name the file and the field path --------------------------------------


def seed_raw() -> dict[str, Any]:
    raw = yaml.safe_load(SEED.read_text())
    assert isinstance(raw, dict)
    return raw


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(raw: dict[str, Any]) -> None:
        target: Any = raw
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value

    return change


INVALID_FIELDS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "unknown top-level key": (_set(("gpus",), 4), "gpus"),
    "unknown stage key": (_set(("stages", 2, "gpu"), 1), "stages.2.gpu"),
    "stage ids not 0..n-1": (_set(("stages", 1, "id"), 5), "stages"),
    "stage ids out of order": (_set(("stages",), seed_raw()["stages"][::-1]), "stages"),
    "final_stage_ids naming no stage": (_set(("final_stage_ids",), [0, 7]), "final_stage_ids"),
    "empty final_stage_ids": (_set(("final_stage_ids",), []), "final_stage_ids"),
    "entry without a colon": (_set(("stages", 0, "entry"), "nocolon"), "stages.0.entry"),
    "replicas 0": (_set(("stages", 0, "replicas"), 0), "stages.0.replicas"),
    "replicas not an int": (_set(("stages", 1, "replicas"), "two"), "stages.1.replicas"),
    "missing name": (lambda raw: raw.pop("name"), "name"),
    "bad forward entry": (_set(("forward",), "no colon here"), "forward"),
}


@pytest.mark.parametrize("case", list(INVALID_FIELDS))
def test_invalid_field_names_the_file_and_the_field_path(case: str, tmp_path: Path) -> None:
    change, field_path = INVALID_FIELDS[case]
    raw = seed_raw()
    change(raw)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        load_pipeline(path)
    message = str(err.value)
    assert str(path) in message
    assert field_path in message, f"{field_path!r} not named in: {message}"


INVALID_FILES: dict[str, tuple[str, str]] = {
    "a list": ("- name: x\n- stages: []\n", "mapping"),
    "a scalar": ("just a string\n", "mapping"),
    "empty": ("", "mapping"),
    "invalid YAML": ("name: [unclosed\nstages: {\n", "YAML"),
    "tab indentation": ("name: x\n\tstages: []\n", "YAML"),
}


@pytest.mark.parametrize("case", list(INVALID_FILES))
def test_invalid_file_names_the_file(case: str, tmp_path: Path) -> None:
    text, what = INVALID_FILES[case]
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_pipeline(path)
    assert str(path) in str(err.value)
    assert what in str(err.value)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "pipeline.yaml"
    with pytest.raises(ConfigError) as err:
        load_pipeline(path)
    assert str(path) in str(err.value)
    assert "cannot read" in str(err.value)


# --- entries --------------------------------------------------------------------


class NotAnEngine:
    """A class entry without add_request / step / abort / has_work."""

    def __init__(self, **options: Any) -> None:
        self.options = options

    def step(self) -> list[Any]:
        return []


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("no_such_module_xyz:fn", "no_such_module_xyz"),
        ("workers.no_such_module:fn", "no_such_module"),
        ("workers.seed:no_such_fn", "no_such_fn"),
        ("workers.omni:Code2Wav.no_such_attr", "no_such_attr"),
    ],
)
def test_resolve_entry_errors_are_config_errors(entry: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_entry(entry)
    assert entry in str(err.value)
    assert problem in str(err.value)


def test_resolve_entry_finds_modules_next_to_the_pipeline_file(
    tmp_path: Path, keep_sys_path: None
) -> None:
    (tmp_path / "my_stage_mod_for_config_test.py").write_text("def fn(data):\n    return data\n")
    try:
        fn = resolve_entry("my_stage_mod_for_config_test:fn", tmp_path)
        assert fn(3) == 3
    finally:
        sys.modules.pop("my_stage_mod_for_config_test", None)


def test_class_entry_that_is_not_a_stage_engine() -> None:
    stage = StageConfig(id=1, name="bad", entry=f"{__name__}:NotAnEngine", options={"a": 1})
    with pytest.raises(ConfigError) as err:
        load_engine(stage, None, max_concurrency=1, wake=lambda: None)
    message = str(err.value)
    assert "stage 1" in message
    assert f"{__name__}:NotAnEngine" in message
    assert "StageEngine" in message


def test_engine_entries_load() -> None:
    engine_stage = StageConfig(id=2, name="code2wav", entry="workers.omni:Code2Wav")
    engine = load_engine(engine_stage, None, max_concurrency=1, wake=lambda: None)
    assert isinstance(engine, StageEngine)
    fn_stage = StageConfig(id=0, name="split", entry="workers.seed:split_words")
    wrapped = load_engine(fn_stage, None, max_concurrency=1, wake=lambda: None)
    assert isinstance(wrapped, GeneratorEngine)
    wrapped.close()


PRELOADED: list[dict[str, object]] = []


def _remember_load(options: dict[str, object]) -> None:
    if options.get("fail"):
        raise ConfigError("no such voice")
    PRELOADED.append(options)


@preloads(_remember_load)
def preloading_stage(data: object, *, size: int = 1, fail: bool = False) -> object:
    return data


def test_a_function_stage_preloads_with_its_options_before_its_first_request() -> None:
    PRELOADED.clear()
    stage = StageConfig(id=0, name="p", entry=f"{__name__}:preloading_stage", options={"size": 3})
    engine = load_engine(stage, None, max_concurrency=1, wake=lambda: None)
    assert PRELOADED == [{"size": 3}]  # at load, before any request
    assert isinstance(engine, GeneratorEngine)
    engine.close()
    failing = StageConfig(id=0, name="p", entry=f"{__name__}:preloading_stage", options={"fail": 1})
    with pytest.raises(ConfigError, match="no such voice"):  # at start, not on a request
        load_engine(failing, None, max_concurrency=1, wake=lambda: None)


# --- settings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:6379/0",
        "redis://127.0.0.1:16379",
        "rediss://user:s3cret@redis.internal:6380/0",
        "rediss://:only-a-password@redis.internal:6380/1",
        "unix:///var/run/redis/redis.sock",
        "unix:///tmp/redis.sock?db=2",
    ],
)
def test_settings_read_omni_redis_url(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_REDIS_URL", url)
    settings = Settings()
    assert settings.redis_url == url
    assert settings.require_redis_url() == url


@pytest.mark.parametrize(
    "url", ["http://localhost:6379/0", "https://redis.internal", "localhost:6379", "tcp://h:1"]
)
def test_settings_reject_other_schemes(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_REDIS_URL", url)
    with pytest.raises(ValidationError) as from_env:
        Settings()
    with pytest.raises(ValidationError) as from_arg:
        Settings(redis_url=url)
    for err in (from_env.value, from_arg.value):
        assert [e["loc"] for e in err.errors()] == [("redis_url",)]
        assert "redis_url" in str(err)


def test_settings_arguments_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_REDIS_URL", "redis://from-env:6379/0")
    monkeypatch.setenv("OMNI_NAMESPACE", "envns")
    settings = Settings(redis_url="redis://from-arg:6379/0", namespace="argns")
    assert (settings.redis_url, settings.namespace) == ("redis://from-arg:6379/0", "argns")


def test_settings_defaults() -> None:
    settings = Settings()
    assert settings.redis_url is None
    assert settings.namespace == "omni"


@pytest.mark.parametrize("namespace", ["omni", "team-a.prod_2", "X", "n" * 64])
def test_namespace_accepted(namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_NAMESPACE", namespace)
    assert Settings().namespace == namespace


@pytest.mark.parametrize(
    "namespace", ["bad ns", "a:b", "a*", "ns/1", "{ns}", "ümlaut", "n" * 65, ""]
)
def test_namespace_rejected(namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_NAMESPACE", namespace)
    with pytest.raises(ValidationError) as err:
        Settings()
    assert [e["loc"] for e in err.value.errors()] == [("namespace",)]


def test_require_redis_url_names_the_variable() -> None:
    settings = Settings()
    with pytest.raises(ConfigError) as err:
        settings.require_redis_url()
    assert "OMNI_REDIS_URL" in str(err.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OMNI_STARTUP_TIMEOUT_S", "0"),
        ("OMNI_READ_COUNT", "0"),
        ("OMNI_BLOCK_MS", "99999"),
        ("OMNI_WORKER_MAX_CONCURRENCY", "-1"),
    ],
)
def test_numeric_settings_validated_from_env(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as err:
        Settings()
    field = name.removeprefix("OMNI_").lower()
    assert [e["loc"] for e in err.value.errors()] == [(field,)]


def test_numeric_settings_read_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_STARTUP_TIMEOUT_S", "1.5")
    monkeypatch.setenv("OMNI_WORKER_MAX_CONCURRENCY", "4")
    settings = Settings()
    assert settings.startup_timeout_s == 1.5
    assert settings.worker_max_concurrency == 4


def test_heartbeat_ttl_is_derived_from_the_interval_and_the_read_block() -> None:
    assert Settings().heartbeat_ttl_s == 5.0
    assert Settings(heartbeat_interval_s=3, block_ms=100).heartbeat_ttl_s == pytest.approx(9.3)
    assert Settings(block_ms=10_000).heartbeat_ttl_s == pytest.approx(33.0)


def test_a_heartbeat_ttl_shorter_than_its_refresh_names_the_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMNI_HEARTBEAT_TTL_S", "1")
    with pytest.raises(ConfigError, match=r"OMNI_HEARTBEAT_TTL_S.*OMNI_HEARTBEAT_INTERVAL_S"):
        Settings.load()
