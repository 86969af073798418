"""The pipeline file (YAML): which stages, in which mode, which of them the user sees."""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from omni_runtime.errors import ConfigError
from omni_runtime.wire.messages import MAX_STAGES

EntryPoint = Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")]
"""`package.module:callable`."""


class StageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Annotated[int, Field(ge=0)]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    entry: EntryPoint
    replicas: Annotated[int, Field(ge=1, le=64)] = 1
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the stage factory (see `stage_api.load_stage`)."""


class OutputsConfig(BaseModel):
    """What the user-facing outputs are, for front ends (HTTP) that turn them into text and audio.

    Stated in the file rather than guessed from stage options: only the pipeline's
    author knows which final stage speaks and at which rate.
    """

    model_config = ConfigDict(extra="forbid")

    text_stage: Annotated[int, Field(ge=0)] | None = None
    """Final stage whose data are text pieces (str), in order."""
    audio_stage: Annotated[int, Field(ge=0)] | None = None
    """Final stage whose data are mono float32 PCM chunks in [-1, 1]."""
    sample_rate: Annotated[int, Field(ge=1000, le=384_000)] = 16000
    """Sample rate of the audio stage's chunks, in Hz."""
    text_separator: Annotated[str, Field(max_length=8)] = ""
    """Put between consecutive text pieces (" " for a stage emitting bare words)."""
    input: Literal["text", "chat", "audio"] = "text"
    """What stage 0 takes as the prompt a front end builds: `text`, a string (a chat's last
    user message); `chat`, `{"messages": [{"role", "content"}, ...]}`; `audio`,
    `{"wav": <bytes of a PCM WAV file>}` (a speech-to-text pipeline)."""
    structured: bool = False
    """Whether the text stage honours a request's `response_format` (`json_object`,
    `json_schema`: params `response_format` and `json_schema`), as the llama.cpp engine
    does; a request for JSON to a pipeline that does not is refused, not answered in prose."""
    tools: bool = False
    """Whether the text stage calls a request's `tools` (params `tools`, `tool_choice`,
    `tool_name`, `parallel_tool_calls`: `core/tool_calls.py`), as the llama.cpp engine
    does; a request with tools to a pipeline that does not is refused, not answered."""
    text_turns: bool = False
    """With `input: audio`: stage 0 also takes a turn with nothing to hear, `{"wav": None,
    "messages": [...]}` (`engines/spoken_turn.py`: pocketsphinx hears no words, the thinker
    reads the conversation), so a typed message, or a tool's output, is answered."""
    speaks_input: bool = True
    """Whether the audio is the input spoken as written, so `/v1/audio/speech` may serve
    the pipeline; false where a thinker answers the input instead (speech of the answer is
    not what that endpoint promises)."""

    @property
    def takes_text(self) -> bool:
        """Whether a typed turn is answered: text or chat input, or `text_turns`."""
        return self.input != "audio" or self.text_turns

    @model_validator(mode="after")
    def _names_something(self) -> OutputsConfig:
        if self.text_stage is None and self.audio_stage is None:
            raise ValueError("outputs needs a text_stage, an audio_stage or both")
        if self.text_stage is not None and self.text_stage == self.audio_stage:
            raise ValueError("text_stage and audio_stage must differ")
        if self.structured and self.text_stage is None:
            raise ValueError("structured (JSON) output needs a text_stage")
        if self.tools and (self.text_stage is None or self.input == "text"):
            raise ValueError("tools need a text_stage taking a conversation (input chat or audio)")
        if self.text_turns and self.input != "audio":
            raise ValueError("text_turns is for a pipeline whose input is audio")
        return self


class PipelineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=64)]
    mode: Literal["sequential", "streaming"] = "sequential"
    final_stage_ids: Annotated[list[int], Field(min_length=1)]
    forward: EntryPoint | None = None
    """`forward_fn(next_stage_id, prompt, previous_stage_data)`; default: the data as is."""
    stages: Annotated[list[StageConfig], Field(min_length=1, max_length=MAX_STAGES)]
    """Stage ids are 0, 1, 2, ... in order: at most `messages.MAX_STAGES` of them."""
    outputs: OutputsConfig | None = None
    """Which final stages carry text and audio (needed by `omni-runtime serve`)."""
    source_dir: Path | None = Field(default=None, exclude=True)
    """Directory of the file it came from: stage modules next to it are importable."""

    @field_validator("stages")
    @classmethod
    def _ids_in_order(cls, stages: list[StageConfig]) -> list[StageConfig]:
        ids = [s.id for s in stages]
        if ids != list(range(len(ids))):
            raise ValueError(f"stage ids must be 0, 1, ... in order, got {ids}")
        return stages

    @model_validator(mode="after")
    def _finals_name_stages(self) -> PipelineConfig:
        ids = [s.id for s in self.stages]
        bad = [f for f in self.final_stage_ids if f not in ids]
        if bad:
            raise ValueError(f"final_stage_ids {bad} name no stage (ids {ids})")
        if self.outputs is not None:
            named = {"text_stage": self.outputs.text_stage, "audio_stage": self.outputs.audio_stage}
            for field, sid in named.items():
                if sid is not None and sid not in self.final_stage_ids:
                    raise ValueError(
                        f"outputs.{field} {sid} is not a final stage "
                        f"(final_stage_ids {self.final_stage_ids})"
                    )
        return self

    @property
    def last_stage(self) -> int:
        return max(self.final_stage_ids)

    @property
    def audio_stage(self) -> int | None:
        """The final stage that speaks, if the file says (`outputs`): a request that wants
        no audio (`modalities` without "audio") is not run through it, nor past it."""
        return None if self.outputs is None else self.outputs.audio_stage

    @property
    def transcript_stage(self) -> int | None:
        """Stage 0 of a pipeline that hears (`input: audio`) when it is a final stage of its
        own, neither the text nor the audio one: what the user said, beside the answer."""
        out = self.outputs
        if out is None or out.input != "audio" or 0 not in self.final_stage_ids:
            return None
        return None if 0 in (out.text_stage, out.audio_stage) else 0

    def stage(self, stage_id: int) -> StageConfig:
        if not 0 <= stage_id < len(self.stages):
            raise ConfigError(f"pipeline {self.name!r} has no stage {stage_id}")
        return self.stages[stage_id]


SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML has it: ~10x faster than the pure-Python one, and
every process of a pipeline reads the file at start-up."""


def load_pipeline(
    path: str | Path, mode: str | None = None, default_mode: str | None = None
) -> PipelineConfig:
    """Read and validate a pipeline file; errors name the file and the field path.
    `mode` overrides the file's; `default_mode` stands in for a file that names none."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=SAFE_LOADER)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read pipeline file: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a pipeline file is a mapping, got {type(raw).__name__}")
    if mode is not None:
        raw["mode"] = mode
    elif default_mode is not None:
        raw.setdefault("mode", default_mode)
    try:
        config = PipelineConfig.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in e.errors()
        )
        raise ConfigError(f"{path}: invalid pipeline: {problems}") from e
    config.source_dir = path.resolve().parent
    return config


def resolve_entry(entry: str, source_dir: Path | None = None) -> Any:
    """Import `module:attr`, looking next to the pipeline file as well as on sys.path."""
    module_name, _, attr_path = entry.partition(":")
    for extra in (source_dir, source_dir.parent if source_dir else None):
        if extra is not None and str(extra) not in sys.path:
            sys.path.append(str(extra))
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr_path.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load entry {entry!r}: {e}") from e
    return obj


def check_stage_options(pipeline: PipelineConfig, stage_ids: Iterable[int]) -> None:
    """Fail at start-up, not on every request, when a stage's `options` do not fit its code.

    A class entry is built as `cls(**options)`, a function called as `fn(data, **options)`.
    """
    for sid in stage_ids:
        stage = pipeline.stage(sid)
        entry = resolve_entry(stage.entry, pipeline.source_dir)
        if not callable(entry):
            raise ConfigError(f"stage {sid} ({stage.name}): entry {stage.entry!r} is not callable")
        try:
            signature = inspect.signature(entry)
        except (TypeError, ValueError):
            continue  # a builtin without a signature: nothing to check against
        try:
            if inspect.isclass(entry):
                signature.bind(**stage.options)
            else:
                signature.bind(None, **stage.options)
        except TypeError as e:
            raise ConfigError(
                f"stage {sid} ({stage.name}): options {sorted(stage.options)} do not fit "
                f"{stage.entry}: {e}"
            ) from None
