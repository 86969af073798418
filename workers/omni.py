"""An omni-style demo: thinker (text tokens) → talker (codec codes) → code2wav (audio).

The "models" are stand-ins (sleeps and sines) but the shapes are real. `workers/omni.yaml`
runs three batching step engines, as a served omni model batches its requests:
`Thinker` and `Talker` make one token for every running request per decode step,
`Code2Wav` synthesises every request's new codes in one step. The generators `thinker`
and `talker` make the same outputs one request per thread (a stage can be written
either way). Every stage reads its input through `with_last` or `ChunkStream`, so
sequential and streaming mode give identical final outputs.

Pacing, as `workers/omni.yaml` sets it (a GPU-served omni model's speeds):

* thinker: `token_delay_ms` per decode step, one token per request (20 ms: 50 tokens/s,
  an LLM's decode rate);
* talker: `code_delay_ms` per codec code, each code `frame_ms` of audio (2 ms per
  20 ms: the talker makes speech 10x faster than real time); a step lasts as long as
  its longest token's codes take;
* code2wav: a step takes the longest audio it makes for one request divided by
  `real_time_factor` (50: a batched vocoder, 50x faster than real time).

Every audio chunk carries `frame_ms` per code of its token, exactly
`len(pcm) / sample_rate` seconds: the listener's clock (`omni_runtime.client.playback`)
needs nothing else. A word of the demo is ~100 ms of audio against ~300 ms
spoken, so at 50 tokens/s audio comes ~6x faster than real time — a thinner
margin against stalls than a real model has.
"""

from __future__ import annotations

import re
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from omni_runtime.stage_api import (
    ChunkStream,
    EngineOutput,
    Final,
    TokenUsage,
    marks_final,
    with_last,
)

CODEBOOK_SIZE = 1024
"""Codes are ints in [0, CODEBOOK_SIZE): the talker makes them, code2wav has a frame each."""

BASE_HZ = 200.0
AMPLITUDE = 0.3
FADE_MS = 2.0

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")

Audio = npt.NDArray[np.float32]


def _sleep_ms(ms: float) -> None:
    if ms > 0:
        time.sleep(ms / 1000)


def tokenize(text: str) -> list[str]:
    """Words and single punctuation marks: "Hello, world!" → Hello , world !"""
    return _TOKEN_RE.findall(text)


@marks_final
def thinker(data: Any, token_delay_ms: float = 20) -> Iterator[Any]:
    """Stage 0: the prompt's tokens, one chunk each; the sleep stands in for decode steps."""
    tokens = tokenize(str(data)) if data is not None else []
    for tok, last in with_last(tokens):
        _sleep_ms(token_delay_ms)
        yield Final(tok) if last else tok


def token_codes(token: str) -> list[int]:
    """One code per character, from crc32 (stable across processes, unlike `hash`)."""
    seed = zlib.crc32(token.encode())
    return [zlib.crc32(f"{i}:{ch}".encode(), seed) % CODEBOOK_SIZE for i, ch in enumerate(token)]


@marks_final
def talker(data: Iterable[Any], code_delay_ms: float = 2) -> Iterator[Any]:
    """Stage 1: per upstream token, `{"token", "codes"}`; `None` tokens ("no output") skipped.

    The sleep, `code_delay_ms` per code, stands in for the decode steps of the codes."""
    for tok, last in with_last(data):
        if tok is None:
            continue
        codes = token_codes(str(tok))
        _sleep_ms(code_delay_ms * len(codes))
        chunk = {"token": str(tok), "codes": codes}
        yield Final(chunk) if last else chunk


class Thinker:
    """Stage 0 as a served LLM runs it (continuous batching): each `step` is one decode step
    of `token_delay_ms` that gives every running request its next token. Same outputs as
    `thinker`; one engine loop instead of a thread per request."""

    def __init__(self, token_delay_ms: float = 20) -> None:
        self.token_delay_ms = token_delay_ms
        self._lock = threading.Lock()
        self._reqs: dict[str, list[str]] = {}
        """Each running request's tokens still to come, last first (popped from the end)."""
        self._ends: dict[str, Final] = {}
        """How each running request will end: "length" if its prompt is longer than its
        `max_tokens`, and its token counts (the prompt's, then the ones it says)."""

    def add_request(self, request_id: str, data: Any, params: dict[str, Any] | None = None) -> None:
        """`params["max_tokens"]`, as an LLM's: at most that many tokens (the request's
        other sampling parameters mean nothing to a stand-in that repeats its prompt)."""
        tokens = tokenize(str(data)) if data is not None else []
        limit = (params or {}).get("max_tokens")
        cut = isinstance(limit, int) and 0 < limit < len(tokens)
        said = tokens[:limit] if cut else tokens
        with self._lock:
            self._reqs[request_id] = said[::-1]
            usage = TokenUsage(len(tokens), len(said))
            self._ends[request_id] = Final(None, "length" if cut else "stop", usage)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._reqs.pop(request_id, None)
            self._ends.pop(request_id, None)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._reqs)

    def step(self) -> list[EngineOutput]:
        _sleep_ms(self.token_delay_ms)  # the decode step, for the whole batch at once
        outputs = []
        with self._lock:
            for rid, left in list(self._reqs.items()):
                tok = left.pop() if left else None
                if left:
                    outputs.append(EngineOutput(rid, tok, False))
                    continue
                del self._reqs[rid]
                end = self._ends.pop(rid)
                outputs.append(
                    EngineOutput(rid, tok, True, None, None, end.finish_reason, end.usage)
                )
        return outputs


@dataclass
class _Request:
    stream: ChunkStream
    pending: list[Any] = field(default_factory=list)
    ended: bool = False
    """Input closed and everything taken: the next step emits this request's last output."""


class _StreamedRequests:
    """What the talker and code2wav share: each request's input as a `ChunkStream` (a
    list in sequential mode is one already closed), all under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reqs: dict[str, _Request] = {}

    def add_request(self, request_id: str, data: Any) -> None:
        """`data`: a list (sequential mode) or a ChunkStream (streaming mode) of chunks."""
        stream = data if isinstance(data, ChunkStream) else ChunkStream(data or (), closed=True)
        with self._lock:
            self._reqs[request_id] = _Request(stream)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._reqs.pop(request_id, None)

    def has_work(self) -> bool:
        with self._lock:
            return any(self._poll(r) for r in self._reqs.values())

    def _poll(self, r: _Request) -> bool:
        """Move new input into `pending`; True if the request has something to emit."""
        closed = r.stream.closed  # read before take: closed then means nothing more will come
        r.pending.extend(self._kept(r.stream.take()))
        r.ended = r.ended or closed
        return bool(r.pending) or r.ended

    def _kept(self, chunks: list[Any]) -> list[Any]:
        return chunks


class Talker(_StreamedRequests):
    """Stage 1 batched the same way: a step takes one upstream token of every request that
    has one and lasts `code_delay_ms` per code of the longest token in the batch. Same
    outputs as `talker` (`None` tokens skipped; an input that closes after its last chunk
    went out ends with a `None`)."""

    def __init__(self, code_delay_ms: float = 2) -> None:
        super().__init__()
        self.code_delay_ms = code_delay_ms

    def _kept(self, chunks: list[Any]) -> list[Any]:
        return [str(t) for t in chunks if t is not None]  # a `None` token: no output

    def step(self) -> list[EngineOutput]:
        batch: list[tuple[str, str | None, bool]] = []
        with self._lock:
            for rid, r in list(self._reqs.items()):
                if not self._poll(r):
                    continue
                tok = r.pending.pop(0) if r.pending else None
                last = r.ended and not r.pending
                batch.append((rid, tok, last))
                if last:
                    del self._reqs[rid]
        chunks = [(rid, None if t is None else {"token": t, "codes": token_codes(t)}, last)
                  for rid, t, last in batch]  # fmt: skip
        longest = max((len(c["codes"]) for _r, c, _l in chunks if c is not None), default=0)
        _sleep_ms(self.code_delay_ms * longest)
        return [EngineOutput(rid, c, last) for rid, c, last in chunks]


class Code2Wav(_StreamedRequests):
    """Stage 2: a step engine turning codes into PCM, all requests with new codes in one batch.

    Each code is a faded sine frame looked up in a table built once, so a step is one
    gather for the whole batch and the same codes always give bit-identical audio.
    One output per upstream chunk; if the input closes after its last chunk was already
    sent, the request ends with an empty finished array.
    """

    def __init__(
        self, sample_rate: int = 16000, frame_ms: float = 20, real_time_factor: float = 0
    ) -> None:
        frame_len = round(sample_rate * frame_ms / 1000)
        if sample_rate <= 0 or frame_len < 1 or real_time_factor < 0:
            raise ValueError(
                f"need sample_rate > 0, frames of >= 1 sample and real_time_factor >= 0 "
                f"(0: no pacing), got sample_rate={sample_rate}, frame_ms={frame_ms}, "
                f"real_time_factor={real_time_factor}"
            )
        self.sample_rate = sample_rate
        self.frame_len = frame_len
        self.real_time_factor = real_time_factor
        self._table = _frame_table(sample_rate, frame_len)
        super().__init__()

    def step(self) -> list[EngineOutput]:
        outputs = self._step()
        if self.real_time_factor and outputs:  # a batch runs in parallel: its longest counts
            samples: dict[str, int] = {}
            for o in outputs:
                if o.data is not None:
                    samples[o.request_id] = samples.get(o.request_id, 0) + len(o.data)
            longest_s = max(samples.values(), default=0) / self.sample_rate
            _sleep_ms(1000 * longest_s / self.real_time_factor)
        return outputs

    def _step(self) -> list[EngineOutput]:
        with self._lock:
            batch = [(rid, r) for rid, r in self._reqs.items() if self._poll(r)]
            outputs: list[EngineOutput] = []
            ok: list[tuple[str, _Request, list[list[int]]]] = []
            for rid, r in batch:
                try:
                    ok.append((rid, r, [_codes_of(c) for c in r.pending]))
                except ValueError as e:
                    del self._reqs[rid]
                    outputs.append(EngineOutput(rid, None, True, error=f"ValueError: {e}"))
            flat = [c for _, _, per_chunk in ok for codes in per_chunk for c in codes]
            audio = self._table[np.asarray(flat, dtype=np.intp)].reshape(-1)
            pos = 0
            for rid, r, per_chunk in ok:
                datas = []
                for codes in per_chunk:
                    end = pos + len(codes) * self.frame_len
                    datas.append(audio[pos:end])
                    pos = end
                if r.ended and not datas:
                    datas.append(np.zeros(0, dtype=np.float32))
                for i, d in enumerate(datas):
                    outputs.append(EngineOutput(rid, d, r.ended and i == len(datas) - 1))
                r.pending = []
                if r.ended:
                    del self._reqs[rid]
            return outputs


def _codes_of(chunk: Any) -> list[int]:
    """A talker chunk's codes (`None` = no codes), checked against the codebook."""
    if chunk is None:
        return []
    codes = chunk.get("codes") if isinstance(chunk, dict) else None
    if not isinstance(codes, list) or not all(
        isinstance(c, int) and not isinstance(c, bool) and 0 <= c < CODEBOOK_SIZE for c in codes
    ):
        raise ValueError(f"expected {{'codes': [int in [0, {CODEBOOK_SIZE})]}}, got {chunk!r:.80}")
    return codes


def _frame_table(sample_rate: int, frame_len: int) -> Audio:
    """Row k: AMPLITUDE * sin at BASE_HZ + k Hz, linear fade in/out against clicks."""
    t = np.arange(frame_len, dtype=np.float64) / sample_rate
    freqs = BASE_HZ + np.arange(CODEBOOK_SIZE, dtype=np.float64)
    env = np.ones(frame_len, dtype=np.float64)
    fade = max(1, min(frame_len // 4, round(sample_rate * FADE_MS / 1000)))
    env[:fade] = np.linspace(0.0, 1.0, fade)
    env[-fade:] *= np.linspace(1.0, 0.0, fade)
    table = AMPLITUDE * np.sin(2 * np.pi * freqs[:, None] * t[None, :]) * env
    return table.astype(np.float32)
