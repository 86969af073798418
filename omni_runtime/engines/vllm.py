"""vLLM's `AsyncLLM` (its `EngineClient`) as an async stage engine: a continuous-batching
thinker on a GPU.

vllm is imported in `start()` only: this module imports, and its stage loads, without it.
Each request's text streams out as it is generated (`RequestOutputKind.DELTA`: one chunk
per new piece of text), its last piece as `Final`. How to run it on a GPU: docs/vllm.md.

```yaml
- id: 0
  name: thinker
  entry: omni_runtime.engines.vllm:VllmEngine
  options:
    model: Qwen/Qwen2.5-0.5B-Instruct
    engine_args: {max_num_seqs: 64, gpu_memory_utilization: 0.8}
    sampling: {temperature: 0.7, max_tokens: 256}
```
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omni_runtime.core import foreign
from omni_runtime.core.foreign import Raised
from omni_runtime.errors import ConfigError
from omni_runtime.stage_api import (
    ChunkStream,
    EngineDead,
    EngineStats,
    Final,
    RequestRefused,
    TokenUsage,
    marks_final,
)

DEFAULT_CAPACITY = 256
"""Reported capacity when `engine_args` has no `max_num_seqs` (vLLM's own default varies)."""
SAMPLING_KEYS = (
    "max_tokens", "temperature", "top_p", "stop", "seed", "frequency_penalty", "presence_penalty",
)  # fmt: skip  # VALID checks each
"""The per-request parameters this engine takes; any other key is another stage's."""


@dataclass(frozen=True)
class VllmApi:
    """The three things the adapter needs from vllm; `real_vllm()` imports them, a test
    passes a fake with the same surface, so that the adapter's own code is what runs."""

    build: Callable[[str, dict[str, Any]], Any]
    """`(model, engine_args) -> AsyncLLM`: called on a thread (a model load blocks)."""
    sampling_params: Callable[..., Any]
    """`SamplingParams(**fields)`."""
    delta: Any
    """`RequestOutputKind.DELTA`: each output carries only the new text."""


def real_vllm() -> VllmApi:
    """vllm's `AsyncLLM`, `AsyncEngineArgs` and `SamplingParams` (imports vllm)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    def build(model: str, engine_args: dict[str, Any]) -> Any:
        return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **engine_args))

    return VllmApi(build, SamplingParams, RequestOutputKind.DELTA)


class VllmEngine:
    """`AsyncLLM` behind the `AsyncStageEngine` protocol (see the module docstring).

    `sampling`: defaults for every request, overridden per request by `max_tokens`,
    `temperature`, `top_p`, `stop`, `seed`, `frequency_penalty` and `presence_penalty` in its
    parameters. `api`: where vllm's classes come from, a `VllmApi` or a `module:function`
    returning one (tests)."""

    def __init__(
        self,
        model: str,
        engine_args: Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
        api: VllmApi | str | None = None,
    ) -> None:
        self.model = model
        self.engine_args = dict(engine_args or {})
        try:
            self.sampling = _checked(dict(sampling or {}), "option `sampling`:")
        except ValueError as e:
            raise ConfigError(f"vLLM engine: {e}") from None
        self._api_source = api
        self._api: VllmApi | None = None
        self._engine: Any = None
        self._active: set[str] = set()
        """Requests between `generate` and their end: the adapter's count for `stats`."""
        self.capacity = int(self.engine_args.get("max_num_seqs", DEFAULT_CAPACITY))

    async def start(self) -> None:
        """Import vllm and build the engine: loads the model (minutes, for a large one)."""
        if self._engine is not None:
            return
        api = self._api = _resolve(self._api_source)
        self._engine = await asyncio.to_thread(api.build, self.model, dict(self.engine_args))

    @marks_final
    async def generate(
        self, request_id: str, data: Any, params: dict[str, Any] | None
    ) -> AsyncIterator[Any]:
        engine, api = self._engine, self._api
        if engine is None or api is None:
            raise EngineDead("vLLM engine not started (or closed)")
        if (params or {}).get("response_format", "text") != "text":
            raise RequestRefused(  # vLLM can (structured outputs); this adapter does not map it
                "JSON output (response_format) is not supported by the vLLM engine",
                "unsupported_parameter",
            )
        if "tools" in (params or {}):
            raise RequestRefused(  # as above: vLLM's tool parsers are not mapped
                "tools (function calling) are not supported by the vLLM engine",
                "unsupported_parameter",
            )
        fields = self.sampling | _checked(
            {k: v for k, v in (params or {}).items() if k in SAMPLING_KEYS}, "parameter"
        )
        sampling = api.sampling_params(**fields, output_kind=api.delta)
        prompt = await _prompt(data)
        self._active.add(request_id)
        prompt_ids: Sequence[int] | None = None  # vLLM's count of the prompt, once it says
        made = 0
        try:
            outputs = engine.generate(prompt, sampling, request_id)
            while True:
                out = await foreign.acall(anext, outputs)
                if isinstance(out, Raised):  # vLLM's errors have no common base: dead or not
                    if isinstance(out.error, StopAsyncIteration):
                        return
                    if engine.errored:
                        raise EngineDead(f"vLLM engine errored: {engine.dead_error!r}") from (
                            out.error
                        )
                    raise out.error
                text = out.outputs[0].text if out.outputs else ""
                prompt_ids = getattr(out, "prompt_token_ids", None) or prompt_ids
                made += len(out.outputs[0].token_ids) if out.outputs else 0  # DELTA: the new
                if out.finished:
                    reason = out.outputs[0].finish_reason if out.outputs else None
                    usage = (
                        None if prompt_ids is None else finished_usage(out, len(prompt_ids), made)
                    )
                    yield Final(text, "length" if reason == "length" else "stop", usage)
                    return
                if text:
                    yield text
        finally:
            self._active.discard(request_id)

    async def abort(self, request_id: str) -> None:
        """Frees the request's batch slot and KV blocks; unknown ids are ignored (by vLLM)."""
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def check_health(self) -> None:
        engine = self._engine
        if engine is None:
            raise EngineDead("vLLM engine not started (or closed)")
        if engine.errored:
            raise EngineDead(f"vLLM engine errored: {engine.dead_error!r}")
        checked = await foreign.acall(engine.check_health)
        if isinstance(checked, Raised):  # any failure of the check: an unhealthy engine
            raise EngineDead(f"vLLM check_health: {checked.describe()}") from checked.error

    def stats(self) -> EngineStats:
        """The adapter's count of its requests: vLLM schedules `capacity` (`max_num_seqs`)
        at once, so those past it are taken as waiting."""
        active = len(self._active)
        running = min(active, self.capacity)
        return EngineStats(running=running, waiting=active - running, capacity=self.capacity)

    async def close(self) -> None:
        """Shut the engine (and its engine-core process) down; a second call does nothing."""
        engine, self._engine = self._engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)


def _resolve(source: VllmApi | str | None) -> VllmApi:
    if source is None:
        try:
            return real_vllm()
        except ImportError as e:
            raise ConfigError(
                f"the vLLM engine needs vllm installed on a GPU host ({e}); see docs/vllm.md"
            ) from e
    if isinstance(source, VllmApi):
        return source
    module, _, name = source.partition(":")
    api = getattr(importlib.import_module(module), name)()
    if not isinstance(api, VllmApi):
        raise ConfigError(f"option api={source!r} returned {type(api).__name__}, not a VllmApi")
    return api


def _number(low: float, high: float, low_open: bool = False) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        return (v > low if low_open else v >= low) and v <= high

    return ok


VALID: Mapping[str, Callable[[Any], bool]] = {
    "max_tokens": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    "temperature": _number(0, float("inf")),
    "top_p": _number(0, 1, low_open=True),
    "stop": lambda v: (
        isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
    ),
    "seed": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2),
}
"""Each sampling field's check: a bad value fails its request with a message naming it,
not deep inside vLLM."""


def _checked(fields: dict[str, Any], where: str) -> dict[str, Any]:
    """`fields`, or `RequestRefused` naming the first bad one (a request's parameters: the
    client's fault; the `sampling` option's: a `ConfigError` at start)."""
    for key, value in fields.items():
        valid = VALID.get(key)
        if valid is None:
            raise RequestRefused(
                f"{where} {key!r} is not one of {', '.join(SAMPLING_KEYS)}", "invalid_value"
            )
        if not valid(value):
            raise RequestRefused(
                f"{where} {key}={value!r} is not valid for vLLM sampling", "invalid_value"
            )
    return fields


async def _prompt(data: Any) -> Any:
    """The prompt: a string (or vLLM's prompt dict) as is; upstream chunks (a list, or a
    `ChunkStream` read to its end) joined into one string."""
    if isinstance(data, str | dict):
        return data
    if isinstance(data, ChunkStream):
        return "".join([str(c) async for c in data if c is not None])
    if isinstance(data, list | tuple):
        return "".join(str(c) for c in data if c is not None)
    raise ValueError(f"vLLM prompt must be text, got {type(data).__name__}")


def finished_usage(out: Any, prompt_tokens: int, made: int) -> TokenUsage:
    """The counts of a finished request; vLLM says how many of its prompt's tokens its
    prefix cache held (`num_cached_tokens`, None when it keeps none)."""
    cached = getattr(out, "num_cached_tokens", None)
    held = min(cached, prompt_tokens) if type(cached) is int and cached > 0 else 0
    return TokenUsage(prompt_tokens, made, held)
