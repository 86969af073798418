"""The omni demo's engines with nothing between them: the floor of the peers benchmark's
sequential cells, and what the worker's loop spends per step around them.

`python -m benchmarks.peers.engines_alone [--conc 1,32] [--n 8,96]`:

- **floor**: `Thinker`, `Talker` and `Code2Wav` with `workers/omni.yaml`'s pacing, each
  stepped on a thread of its own, a finished request's outputs handed to the next
  engine in memory (sequential mode), under `load.closed_loop`'s users and think times
  (the same draws). Prints E2E p50 and each stage's span p50 (from its input to its last
  output), the figures no runtime can beat on this machine.
- **streaming floor** (`--streaming`): the same engines and users, each output handed to
  the next engine's input stream (a `ChunkStream`) the moment its step returns, as the
  runtime's streaming mode does over Redis. Prints TTFA and E2E p50 (p99): the floor of
  the peers benchmark's streaming cells.
- **pass cost**: a `WorkerCore` driving an unpaced `Thinker` and `Talker` with 32 requests
  (sequential inputs): the core's own time per step (bookkeeping and encoding every
  output), i.e. what a loop that steps the engine itself adds to each step period.
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness.stats import percentile
from benchmarks.peers.load import prompt_tokens
from benchmarks.ttfp import THINK_MAX_S
from omni_runtime.observe.metrics import Metrics
from omni_runtime.stage_api import ChunkStream, EngineOutput
from omni_runtime.wire.messages import StageInputMsg
from omni_runtime.worker.actions import Input
from omni_runtime.worker.core import WorkerCore
from workers.omni import Code2Wav, Talker, Thinker

Done = Callable[[str, list[Any]], None]


class _Stage(threading.Thread):
    """One engine stepped while it has work; each output goes to `emit` as its step returns.
    Its inbox takes new requests, and nudges (None: an upstream extended a stream it reads)."""

    def __init__(self, engine: Any, emit: Callable[[EngineOutput], None]) -> None:
        super().__init__(daemon=True)
        self.engine, self.emit = engine, emit
        self.inbox: queue.Queue[tuple[str, Any] | None] = queue.Queue()

    def run(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_work()
            try:
                while True:
                    item = self.inbox.get(block=block)
                    if item is not None:
                        engine.add_request(*item)
                    block = False
            except queue.Empty:
                pass
            if engine.has_work():
                for out in engine.step():
                    self.emit(out)


def _whole(done: Done) -> Callable[[EngineOutput], None]:
    """An `emit` that gathers each request's outputs and hands them to `done` at its end."""
    outs: dict[str, list[Any]] = {}

    def emit(out: EngineOutput) -> None:
        got = outs.setdefault(out.request_id, [])
        if out.data is not None:
            got.append(out.data)
        if out.finished:
            done(out.request_id, outs.pop(out.request_id))

    return emit


def _users(conc: int, n: int, start: Callable[[str], threading.Event]) -> None:
    """`load.closed_loop`'s users: each waits its think time, then one request to its end."""
    left = [n]
    lock = threading.Lock()

    def user(i: int) -> None:
        think = random.Random(f"{conc}-{i}")
        for k in range(n):
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            time.sleep(think.uniform(0.0, THINK_MAX_S))
            start(f"u{i}-{k}").wait()

    users = [threading.Thread(target=user, args=(i,)) for i in range(conc)]
    for u in users:
        u.start()
    for u in users:
        u.join()


def streaming_floor(conc: int, n: int) -> None:
    prompt, _tokens = prompt_tokens()
    sent: dict[str, float] = {}
    first_audio: dict[str, float] = {}
    ended_at: dict[str, float] = {}
    ended: dict[str, threading.Event] = {}
    talker_in: dict[str, ChunkStream] = {}
    code2wav_in: dict[str, ChunkStream] = {}

    def heard(out: EngineOutput) -> None:
        now = time.perf_counter()
        if out.data is not None and len(out.data) and out.request_id not in first_audio:
            first_audio[out.request_id] = now
        if out.finished:
            ended_at[out.request_id] = now
            ended[out.request_id].set()

    def handed(streams: dict[str, ChunkStream], stage: _Stage) -> Callable[..., None]:
        def emit(out: EngineOutput) -> None:
            data = [] if out.data is None else [out.data]
            streams[out.request_id].extend(data, closed=out.finished)
            stage.inbox.put(None)

        return emit

    code2wav = _Stage(Code2Wav(16000, 20, 50), heard)
    talker = _Stage(Talker(2), handed(code2wav_in, code2wav))
    thinker = _Stage(Thinker(20), handed(talker_in, talker))
    for stage in (code2wav, talker, thinker):
        stage.start()

    def start(rid: str) -> threading.Event:
        ended[rid] = threading.Event()
        talker_in[rid], code2wav_in[rid] = ChunkStream(), ChunkStream()
        talker.inbox.put((rid, talker_in[rid]))
        code2wav.inbox.put((rid, code2wav_in[rid]))
        sent[rid] = time.perf_counter()
        thinker.inbox.put((rid, prompt))
        return ended[rid]

    _users(conc, n, start)
    ttfa = [(first_audio[r] - t) * 1e3 for r, t in sent.items()]
    e2e = [(ended_at[r] - t) * 1e3 for r, t in sent.items()]
    print(
        f"floor, streaming, c={conc}: TTFA p50 {percentile(ttfa, 50):.1f} ms "
        f"(p99 {percentile(ttfa, 99):.1f}), E2E p50 {percentile(e2e, 50):.0f} ms "
        f"(p99 {percentile(e2e, 99):.0f}) over {len(e2e)}"
    )


def floor(conc: int, n: int) -> None:
    prompt, _tokens = prompt_tokens()
    marks: dict[str, list[float]] = {}
    ended: dict[str, threading.Event] = {}

    def then(stage: _Stage | None) -> Done:
        def done(rid: str, outs: list[Any]) -> None:
            marks[rid].append(time.perf_counter())
            if stage is None:
                ended[rid].set()
            else:
                stage.inbox.put((rid, outs))

        return done

    code2wav = _Stage(Code2Wav(16000, 20, 50), _whole(then(None)))
    talker = _Stage(Talker(2), _whole(then(code2wav)))
    thinker = _Stage(Thinker(20), _whole(then(talker)))
    for stage in (code2wav, talker, thinker):
        stage.start()

    def start(rid: str) -> threading.Event:
        ended[rid] = threading.Event()
        marks[rid] = [time.perf_counter()]
        thinker.inbox.put((rid, prompt))
        return ended[rid]

    _users(conc, n, start)
    spans = [[(m[i + 1] - m[i]) * 1e3 for i in range(3)] for m in marks.values()]
    e2e = [(m[3] - m[0]) * 1e3 for m in marks.values()]
    stages = ", ".join(
        f"{name} {percentile([s[i] for s in spans], 50):.0f}"
        for i, name in enumerate(("thinker", "talker", "code2wav"))
    )
    print(
        f"floor, sequential, c={conc}: E2E p50 {percentile(e2e, 50):.0f} ms "
        f"(p99 {percentile(e2e, 99):.0f}) over {len(e2e)}; span p50 ms: {stages}"
    )


class _Timed:
    """An engine whose step time is summed, so the rest of a pass can be told apart."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.step_s = 0.0

    def add_request(self, request_id: str, data: Any) -> None:
        self.engine.add_request(request_id, data)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_work(self) -> bool:
        return bool(self.engine.has_work())

    def step(self) -> list[EngineOutput]:
        t0 = time.perf_counter()
        out: list[EngineOutput] = self.engine.step()
        self.step_s += time.perf_counter() - t0
        return out


def pass_cost(conc: int = 32, reps: int = 5) -> None:
    prompt, tokens = prompt_tokens()
    for name, make, data in (
        ("thinker", lambda: Thinker(token_delay_ms=0), prompt),
        ("talker", lambda: Talker(code_delay_ms=0), tokens),
    ):
        per_step: list[float] = []
        for rep in range(reps):
            engine = _Timed(make())
            core = WorkerCore(
                engine, 1, name, sends_chunks=False, receives_chunks=False,
                max_message_bytes=1 << 24, input_timeout_s=60, metrics=Metrics(),
            )  # fmt: skip
            for i in range(conc):
                msg = StageInputMsg(request_id=f"r{rep}-{i}", data=data, streaming=False)
                core.on_input(Input(f"{i}-0".encode(), msg), now=0)
            steps, t0 = 0, time.perf_counter()
            while core.in_flight:
                core.step()
                core.take_actions()
                steps += 1
            per_step.append((time.perf_counter() - t0 - engine.step_s) / steps * 1e3)
        print(
            f"pass cost, {name}, c={conc}: {statistics.median(per_step):.3f} ms per step "
            f"(median of {reps}; range {min(per_step):.3f}-{max(per_step):.3f})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conc", default="1,32")
    p.add_argument("--n", default="8,96")
    p.add_argument("--streaming", action="store_true", help="the streaming floor only")
    args = p.parse_args()
    if not args.streaming:
        pass_cost()
    for conc, n in zip(args.conc.split(","), args.n.split(","), strict=True):
        (streaming_floor if args.streaming else floor)(int(conc), int(n))


if __name__ == "__main__":
    main()
