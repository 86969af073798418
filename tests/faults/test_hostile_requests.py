"""Hostile requests mixed with good ones, real processes on a real redis-server.

Hostile values come from the schema's property-test strategies (`tests/hostile.py`):
requests written straight onto the requests stream as a hostile client would (redis-py,
no checks), some handed to `OmniClient.submit` (which must refuse them itself), plus
malformed aborts on the control stream and malformed entries on every stage's input and
output stream; then requests that reuse a live request's id, and valid requests whose
deadline exceeds the deployment's limit. The good requests run through it all at
concurrency 20.

Holds: every good request exact; every hostile one refused at submit, or ending with
one error final (every request that names a valid id and client), or dead-lettered
(those that do not); no slot stops (a good load after it is exact, the orchestrator
alive and holding its lease); nothing pending in any group; every malformed entry of
every stream, control included, dead-lettered: the dead-letter stream grew by exactly
their number. Short by default; `OMNI_FAULTS_FULL=1`: 10,000 hostile, 200 good.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from omni_runtime import keys
from omni_runtime.client.client import OmniClient
from omni_runtime.errors import CodecError
from omni_runtime.wire import codec, messages
from omni_runtime.wire.messages import ClientCommand, ClientId, RequestId
from tests.faults.harness import FULL, FaultDeployment, header, run_load, seed_final_2
from tests.hostile import HOSTILE, Deep, draw_many, hostile_docs, materialized, raw, valid_docs

pytestmark = [pytest.mark.timeout(900), pytest.mark.redis_server]

HOSTILE_CLIENTS = [f"hostile-{i}" for i in range(4)]
MAX_DEADLINE_S = 900.0
BATCH = 100
COMMAND: TypeAdapter[Any] = TypeAdapter(ClientCommand)
ADDRESS: TypeAdapter[Any] = TypeAdapter(tuple[RequestId, ClientId])
Fields = dict[Any, Any]


def is_valid(doc: dict[str, Any]) -> bool:
    """Whether the orchestrator's reader would accept it (the model path)."""
    try:
        COMMAND.validate_python(codec.decode(raw(doc)))
    except (ValidationError, CodecError):
        return False
    return True


def addressable(doc: dict[str, Any]) -> bool:
    """Whether an invalid request names whom to answer, readably (its id and client valid,
    and not nested past any reader's recursion: that one is only dead-lettered)."""
    prompt = doc.get("prompt")
    if isinstance(prompt, Deep) and prompt.depth >= 1000:
        return False
    try:
        ADDRESS.validate_python((doc.get("request_id"), doc.get("client_id")))
    except ValidationError:
        return False
    return True


class HostileLoad:
    """What a hostile writer sends, by stream, and what each should come to."""

    def __init__(self, d: FaultDeployment, n: int) -> None:
        names = d.settings.names
        self.names = names
        share = max(1, n // 10)
        kinds = st.sampled_from(["request"] * 6 + ["abort", "control", "stage_in", "stage_out"])
        picks = draw_many(kinds.flatmap(_doc_of), n - 2 * share, seed=25)
        self.requests: list[dict[str, Any]] = []
        self.entries: dict[str, list[Fields]] = collections.defaultdict(list)
        """stream → the hostile entries written on it (every one to be dead-lettered)."""
        for i, (kind, doc) in enumerate(picks):
            if kind == "request":  # a unique id and a client that reads its answers
                self.requests.append(self._addressed(doc, i))
            elif kind == "abort":
                self.requests.append(doc)
            else:
                stream = {
                    "control": names.control,
                    "stage_in": names.stage_in(i % 3),
                    "stage_out": names.stage_out(i % 3),
                }[kind]
                self.entries[stream].append(entry(doc))
        over = st.floats(MAX_DEADLINE_S, messages.MAX_DEADLINE_S, exclude_min=True)
        self.too_long = [
            {**self._addressed(doc, n + i), "deadline_s": deadline}
            for i, (doc, deadline) in enumerate(
                draw_many(st.tuples(valid_docs("request"), over), share, seed=26)
            )
        ]
        self.at_submit = draw_many(submit_kwargs(), share, seed=27)
        junk = [{b"m": b"\xc1 not msgpack"}, {b"other": b"field"}]
        for k in range(3):
            for stream in (names.requests, names.control, names.stage_in(k), names.stage_out(k)):
                self.entries[stream].extend(junk)
        for doc in self.requests:
            assert not is_valid(doc), doc  # the strategies' promise, checked
            self.entries[names.requests].append(entry(doc))

    def _addressed(self, doc: dict[str, Any], i: int) -> dict[str, Any]:
        """`doc` with a fresh id and a hostile client's id, where its own were valid (an
        invalid one stays: that is what makes it hostile)."""
        out = dict(doc)
        if addressable({"request_id": out.get("request_id"), "client_id": "c"}):
            out["request_id"] = f"h{i}"
        if addressable({"request_id": "r", "client_id": out.get("client_id")}):
            out["client_id"] = HOSTILE_CLIENTS[i % len(HOSTILE_CLIENTS)]
        return out

    def sent_as(self) -> dict[str, Any]:
        """request id → the doc sent under it (what a failure message shows)."""
        return {
            doc["request_id"]: doc for doc in [*self.requests, *self.too_long] if addressable(doc)
        }

    def dead_expected(self) -> int:
        return sum(len(entries) for entries in self.entries.values())

    def answers_expected(self) -> dict[str, str]:
        """request id → the start of its one error final, for each answerable one."""
        want = {
            doc["request_id"]: "invalid request: "
            for doc in self.requests
            if doc.get("type") == "request" and addressable(doc)
        }
        want.update({doc["request_id"]: "deadline_s=" for doc in self.too_long})
        return want

    def write(self, r: redis.Redis) -> None:
        """Every hostile entry, in batches, streams interleaved; then the valid requests
        whose deadline is too long."""
        queues = {stream: list(entries) for stream, entries in self.entries.items()}
        while any(queues.values()):
            with r.pipeline(transaction=False) as pipe:
                for stream, entries in queues.items():
                    for fields in entries[:BATCH]:
                        pipe.xadd(stream, fields)
                    del entries[:BATCH]
                pipe.execute()
        with r.pipeline(transaction=False) as pipe:
            for doc in self.too_long:
                pipe.xadd(self.names.requests, entry(doc))
            pipe.execute()


def _doc_of(kind: str) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    of = {"control": "abort", "stage_in": "stage_input", "stage_out": "stage_output"}
    return hostile_docs(of.get(kind, kind)).map(lambda doc: (kind, doc))


def entry(doc: dict[str, Any]) -> Fields:
    return {keys.PAYLOAD_FIELD.encode(): raw(doc)}


@st.composite
def submit_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    """What `OmniClient.submit` is handed by a careless caller: one bad argument."""
    h = HOSTILE["request"]
    name, values = draw(
        st.sampled_from(
            [
                ("deadline_s", h["deadline_s"]),
                ("prompt", h["prompt"].filter(lambda deep: deep.depth <= 1000)),
                ("params", h["params"].filter(bool)),
                ("trace", h["trace"].filter(lambda v: v is not None)),
                ("request_id", h["request_id"].filter(bool)),
                ("deadline_s", st.floats(MAX_DEADLINE_S, 1e6, exclude_min=True)),
            ]
        )
    )
    return {"prompt": "a b", name: materialized(draw(values))}


def hostile_finals(d: FaultDeployment) -> dict[str, list[Fields]]:
    """request id → the finals the hostile clients' streams hold for it."""
    out: dict[str, list[Fields]] = collections.defaultdict(list)
    for cid in HOSTILE_CLIENTS:
        stream = d.settings.names.client_out(cid)
        for _id, fields in cast("list[tuple[bytes, Fields]]", d.redis.xrange(stream)):
            for msg in _messages(fields):
                if msg["finished"]:
                    out[msg["request_id"]].append(msg)
    return out


def _messages(fields: Fields) -> list[dict[str, Any]]:
    got = codec.decode(fields[keys.PAYLOAD_FIELD.encode()])
    return got if isinstance(got, list) else [got]


async def settled(cond: Callable[[], bool], deadline_s: float = 60.0) -> None:
    """Wait (polling Redis a few times a second) until `cond`; the asserts after say what
    is missing if it never holds."""
    end = time.monotonic() + deadline_s
    while not cond() and time.monotonic() < end:
        await asyncio.sleep(0.2)


def dead_added(d: FaultDeployment) -> int:
    key = d.settings.names.dead_letters
    return int(d.redis.xinfo_stream(key)["entries-added"]) if d.redis.exists(key) else 0


def pending(d: FaultDeployment) -> dict[str, int]:
    names = d.settings.names
    groups = [(names.requests, keys.ORCHESTRATOR_GROUP), (names.control, keys.ORCHESTRATOR_GROUP)]
    for k in range(3):
        groups += [
            (names.stage_out(k), keys.ORCHESTRATOR_GROUP),
            (names.stage_in(k), keys.WORKERS_GROUP),
        ]
    return {
        f"{stream}/{group}": int(d.redis.xpending(stream, group)["pending"])
        for stream, group in groups
    }


async def test_hostile_requests_fail_alone_and_every_slot_serves_on(
    redis_url: str, tmp_path: Path
) -> None:
    n_hostile, n_good, n_dups = (10_000, 200, 100) if FULL else (1_000, 50, 20)
    env = {"OMNI_MAX_DEADLINE_S": str(MAX_DEADLINE_S)}
    with FaultDeployment(redis_url, tmp_path, "seed.yaml", env=env, final_stage_ids=[2]) as d:
        d.settings = d.settings.model_copy(update={"max_deadline_s": MAX_DEADLINE_S})
        names = d.settings.names
        started = time.monotonic()
        load = HostileLoad(d, n_hostile)
        made_s = time.monotonic() - started
        for cid in HOSTILE_CLIENTS:  # alive: their requests are not aborted as gone
            d.redis.set(names.client_heartbeat(cid), 1, px=600_000)
        dead_before = dead_added(d)
        refused_at_submit: list[str] = []

        async def hostile() -> None:
            async with OmniClient(d.settings) as careless:
                for kwargs in load.at_submit:
                    try:
                        await careless.submit(**kwargs)
                    except CodecError as e:
                        refused_at_submit.append(str(e))
            await asyncio.to_thread(load.write, d.redis)

        prompts = {f"g{i}": f"a{i} b{i} c{i}" for i in range(n_good)}
        report = await run_load(d, "hostile requests", prompts, seed_final_2, 20, 1, hostile)

        # A live id reused: the original (a hostile client's, valid) and a copy from
        # another client with another prompt, read in one batch (one MULTI).
        with d.redis.pipeline(transaction=True) as pipe:
            for i in range(n_dups):
                doc = {"type": "request", "request_id": f"dup{i}", "prompt": f"d{i}"}
                pipe.xadd(names.requests, entry({**doc, "client_id": HOSTILE_CLIENTS[0]}))
                copy = {**doc, "client_id": HOSTILE_CLIENTS[1], "prompt": "other"}
                pipe.xadd(names.requests, entry(copy))
            pipe.execute()

        after = await run_load(
            d, "good, after", {f"z{i}": f"z{i}" for i in range(20)}, seed_final_2, 20
        )
        want = load.answers_expected()
        n_answers = len(want) + 2 * n_dups
        await settled(lambda: sum(map(len, hostile_finals(d).values())) >= n_answers)
        await settled(lambda: dead_added(d) >= dead_before + load.dead_expected())
        await settled(lambda: not any(pending(d).values()))
        finals = hostile_finals(d)
        dead = dead_added(d) - dead_before
        d.group.check_alive()
        lease = d.redis.get(names.orchestrator_lease(0))

    errors = collections.Counter(
        (msg["error"] or "ok").split(":")[0].split("=")[0] for fs in finals.values() for msg in fs
    )
    print(
        "\n" + header() + "\n" + report.line() + "\n" + after.line()
        + f"\n  hostile: {n_hostile} made in {made_s:.1f}s; refused at submit"
        f" {len(refused_at_submit)}/{len(load.at_submit)}; finals {dict(errors)};"
        f" dead-lettered {dead}/{load.dead_expected()}; reused ids {n_dups}"
    )  # fmt: skip
    assert (report.ok, report.wrong, report.lost, report.failed) == (n_good, 0, 0, 0), report
    assert (after.ok, after.wrong, after.lost, after.failed) == (20, 0, 0, 0), after
    assert len(refused_at_submit) == len(load.at_submit)
    missing = sorted(set(want) - set(finals))
    assert not missing, [(rid, d_) for rid, d_ in load.sent_as().items() if rid in missing[:5]]
    for rid, start in want.items():
        (final,) = finals[rid]
        assert final["error"].startswith(start), (rid, final)
    for i in range(n_dups):  # the original ran (a hostile client's, valid); the copy refused
        original, copy = finals[f"dup{i}"]
        assert (original["error"], original["data"]) == (None, f"wav:D{i}"), original
        assert copy["error"] == f"duplicate request id: request 'dup{i}' is in flight already"
    assert set(finals) == set(want) | {f"dup{i}" for i in range(n_dups)}
    assert dead == load.dead_expected()
    assert lease is not None
