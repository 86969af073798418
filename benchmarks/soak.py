"""A served deployment under mixed traffic, round after round: does any process's memory
keep growing, does any request fail, is anything left behind in Redis?

`omni-runtime serve --pipeline workers/voice.yaml --pipeline workers/transcribe.yaml`
(the real models; its own redis-server, as a user runs it), and eight users, each
sending one after another, at random: text chats (whole or streamed), spoken answers
(streamed; half of them left after their second audio chunk), Responses API turns in a
conversation made and deleted for them, transcriptions of a spoken answer, and Realtime
sessions (answered, cancelled after two audio deltas, or closed mid-answer). After each
round: every process's resident memory (`/proc/<pid>/statm`).

Baseline: each process's memory after the warm-up round, in the same run. A process
holds no memory per request once its growth over the second half of the rounds is small
per 1,000 requests; the thinker's grows until llama.cpp's prompt cache is full, a bound
of its own (`cache_ram_mib`, docs/engines.md). At the end: no stream entry pending, no
chunk key left. A quick run's memory rows are shown, not judged: over a few hundred
requests the allocator's churn alone reads as several MB per 1,000.
"""

from __future__ import annotations

import asyncio
import base64
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import redis

from benchmarks.harness import scenario
from benchmarks.harness.report import ROOT, Row
from benchmarks.harness.serve import ServeProcess

PIPELINES = ("voice", "transcribe")
GROWTH_MB_PER_1000 = 2.0
"""A process that grows less than this per 1,000 requests once warm holds nothing per
request (the allocator's own churn is of this order)."""
THINKER_CACHE_MB = 512 + 128
"""The thinker's growth bound: llama.cpp's prompt cache (512 MiB) and its arenas."""


@dataclass(frozen=True)
class Sizes:
    rounds: int
    round_s: float
    users: int = 8


FULL = Sizes(rounds=6, round_s=120)
QUICK = Sizes(rounds=3, round_s=40)


class Traffic:
    """The users' requests, each kind a coroutine that raises if its answer is wrong."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.oai = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        self.wav: bytes | None = None
        self.kinds: dict[str, Callable[[], Awaitable[None]]] = {
            "chat text": self.chat_text, "chat audio": lambda: self.chat_audio(False),
            "chat audio, left": lambda: self.chat_audio(True),
            "conversation": self.conversation, "transcription": self.transcription,
            "realtime": lambda: self.realtime("answer"),
            "realtime, cancelled": lambda: self.realtime("cancel"),
            "realtime, closed": lambda: self.realtime("close"),
        }  # fmt: skip

    async def chat_text(self) -> None:
        ask: Any = [{"role": "user", "content": "Name a colour."}]
        if random.random() < 0.5:
            await self.oai.chat.completions.create(model="voice", messages=ask, max_tokens=24)
            return
        stream = await self.oai.chat.completions.create(
            model="voice", messages=ask, max_tokens=24, stream=True
        )
        async for _ in stream:
            pass

    async def chat_audio(self, leave: bool) -> None:
        body = {"model": "voice", "messages": [{"role": "user", "content": "Say hello."}],
                "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"},
                "stream": True, "max_tokens": 32}  # fmt: skip
        async with (
            httpx.AsyncClient(timeout=120) as http,
            http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as resp,
        ):
            resp.raise_for_status()
            heard = 0
            async for line in resp.aiter_lines():
                heard += '"audio"' in line and '"data"' in line
                if leave and heard == 2:
                    return
        assert heard, "no audio"

    async def conversation(self) -> None:
        conv = await self.oai.conversations.create()
        for said in ("Remember the number seven.", "What number?"):
            await self.oai.responses.create(
                model="voice", input=said, conversation=conv.id, max_output_tokens=24
            )
        items = [item async for item in self.oai.conversations.items.list(conv.id)]
        assert len(items) == 4, items
        await self.oai.conversations.delete(conv.id)

    async def transcription(self) -> None:
        if self.wav is None:
            said = await self.oai.chat.completions.create(
                model="voice", messages=[{"role": "user", "content": "Say: good morning."}],
                modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"},
                max_tokens=24,
            )  # fmt: skip
            audio = said.choices[0].message.audio
            assert audio is not None
            self.wav = base64.b64decode(audio.data)
        heard = await self.oai.audio.transcriptions.create(
            model="transcribe", file=("said.wav", self.wav)
        )
        assert heard.text.strip(), "nothing heard"

    async def realtime(self, how: str) -> None:
        async with self.oai.realtime.connect(model="voice") as conn:
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Tell me about the sea."}]})  # fmt: skip
            await conn.response.create()
            deltas = 0
            async for ev in conn:
                if ev.type == "error":
                    raise RuntimeError(f"realtime: {ev.error}")
                deltas += ev.type == "response.output_audio.delta"
                if deltas == 2 and how == "close":
                    return
                if deltas == 2 and how == "cancel":
                    await conn.response.cancel()
                if ev.type == "response.done":
                    status = ev.response.status  # incomplete: at the thinker's max_tokens
                    assert status in ("completed", "cancelled", "incomplete"), status
                    return

    async def round(self, seconds: float, users: int, outcomes: Counter[str]) -> None:
        end = time.monotonic() + seconds

        async def user(rng: random.Random) -> None:
            while time.monotonic() < end:
                kind = rng.choice(list(self.kinds))
                try:
                    await asyncio.wait_for(self.kinds[kind](), 180)
                    outcomes[f"{kind}: ok"] += 1
                except Exception as e:  # counted and reported: the point of the run
                    outcomes[f"{kind}: failed"] += 1
                    outcomes[f"error: {type(e).__name__}: {str(e)[:120]}"] += 1

        await asyncio.gather(*(user(random.Random(k)) for k in range(users)))


def processes(root: int) -> dict[str, int]:
    """`serve` and every process under it, named by the log each writes (else its pid)."""
    found, todo = {"serve": root}, [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = Path(f"/proc/{pid}/task").iterdir()
            children = [int(c) for t in tasks for c in (t / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            name = "redis-server" if any(b"redis-server" in c for c in cmd) else None
            named = _log_name(child) or name or str(child)
            found[f"{named}-{child}" if named in found else named] = child
            todo.append(child)
    return found


def _log_name(pid: int) -> str | None:
    """A worker's or orchestrator's name: the log its output goes to."""
    try:
        target = Path(f"/proc/{pid}/fd/1").readlink().name
    except OSError:
        return None
    return target.removesuffix(".log") if target.endswith(".log") else None


def resident_mb(pid: int) -> float | None:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096 / 2**20
    except (OSError, IndexError, ValueError):
        return None


def leftovers(serve_log: str) -> dict[str, int]:
    """What the deployment's Redis holds that it should not once idle."""
    port = re.search(r"on redis-server on port (\d+)", serve_log)
    assert port, "serve did not say where its redis-server is"
    r = redis.Redis(port=int(port.group(1)))
    chunks = sum(1 for _ in r.scan_iter(match="*:chunk:*", count=1000))
    pending = 0
    for key in r.scan_iter(match="*:stage:*", count=1000):
        for group in r.xinfo_groups(key) if r.type(key) == b"stream" else []:
            pending += int(group["pending"])
    return {"chunk keys": chunks, "pending entries": pending}


async def soak(url: str, pids: dict[str, int], sizes: Sizes) -> tuple[list[dict[str, float]],
                                                                        list[int], Counter[str]]:  # fmt: skip
    traffic, outcomes = Traffic(url), Counter[str]()
    memory: list[dict[str, float]] = []
    served: list[int] = []
    for r in range(sizes.rounds + 1):  # round 0 warms up: models, arenas, caches
        before = sum(v for k, v in outcomes.items() if k.endswith(": ok"))
        await traffic.round(sizes.round_s, sizes.users, outcomes)
        served.append(sum(v for k, v in outcomes.items() if k.endswith(": ok")) - before)
        memory.append({name: mb for name, pid in pids.items() if (mb := resident_mb(pid))})
        print(f"round {r}: {served[-1]} requests, "
              f"{ {k: round(v) for k, v in memory[-1].items()} } MB", flush=True)  # fmt: skip
    return memory, served, outcomes


def run(ctx: scenario.Context, sizes: Sizes) -> list[Row]:
    args = [a for name in PIPELINES for a in ("--pipeline", str(ROOT / "workers" / f"{name}.yaml"))]
    with ServeProcess(ctx.log_dir / "serve.log", *args) as serve:
        pids = processes(serve.pid)
        memory, served, outcomes = asyncio.run(soak(serve.url, pids, sizes))
        left = leftovers(serve.log_path.read_text(errors="replace"))
    cfg = f"voice + transcribe, {sizes.users} users, {sizes.rounds} x {sizes.round_s:g} s"
    half = len(memory) // 2
    later = sum(served[half + 1 :]) / 1000
    rows = []
    for name in memory[0]:
        warm, mid, end = memory[0][name], memory[half][name], memory[-1][name]
        growth = (end - mid) / later if later else float("nan")
        thinker = "thinker" in name
        met = end - warm <= THINKER_CACHE_MB if thinker else growth <= GROWTH_MB_PER_1000
        judged = not ctx.quick  # a quick run's few hundred requests: a MB of churn is 4/1k
        target = (f"<= {THINKER_CACHE_MB} MB over warm-up (its prompt cache)" if thinker
                  else f"<= {GROWTH_MB_PER_1000} MB / 1,000 requests once warm")  # fmt: skip
        rows.append(Row(
            "soak", cfg, f"{name}: memory growth, second half", "MB/1k req", growth,
            baseline=f"after warm-up: {warm:.0f} MB", target=target, met=met if judged else None,
            notes=[f"{name}, resident MB by round: {[round(m[name]) for m in memory]}"],
        ))  # fmt: skip
    failed = sum(v for k, v in outcomes.items() if k.endswith(": failed"))
    errors = [f"{k} x{v}" for k, v in outcomes.items() if k.startswith("error:")]
    rows.append(Row(
        "soak", cfg, "requests failed", "", failed, target="0", met=failed == 0,
        notes=[f"requests per round: {served}", *errors[:10]],
        details={"outcomes": dict(outcomes)},
    ))  # fmt: skip
    for what, n in left.items():
        rows.append(Row("soak", cfg, f"{what} left when idle", "", n, target="0", met=n == 0))
    return rows


if __name__ == "__main__":
    raise SystemExit(scenario.main("soak", __doc__, run, FULL, QUICK))
