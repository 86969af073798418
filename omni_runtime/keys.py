"""Every Redis name and default TTL the runtime uses, in one place.

No other module builds a key string or hard-codes a TTL: a reader of this file
knows everything the runtime can leave behind in Redis and for how long.

Redis Cluster: a name's slot is the hash of its first `{...}` (its hash tag) when
it has one, of the whole name otherwise. Names that one command, transaction or
script touches together must share a tag, built by `hash_tag` and nothing else.
Chunk-plane names are tagged by request (a request's chunks and route keys share
a slot; requests spread over the shards). Every stream is a name of its own, so
each lands on one shard as a whole (see docs/cluster.md). A namespace never
contains braces (`Settings.namespace`), so the first `{` of a name is its tag.
"""

from __future__ import annotations


def hash_tag(part: str) -> str:
    """`{part}`: every name carrying the same tag hashes to the same cluster slot."""
    return f"{{{part}}}"


# --- data plane (ChunkAdapter) -------------------------------------------------

CHUNK_TTL_S = 300
"""A chunk nobody consumes (receiver died, request aborted) expires after this."""


def chunk_key(request_id: str, stage_id: int, chunk_id: int, prefix: str = "") -> str:
    """`<req>_<stage>_<id>` (SPEC §4), optionally behind a namespace prefix."""
    return f"{prefix}{request_id}_{stage_id}_{chunk_id}"


def split_chunk_key(key: str) -> tuple[str, int, int]:
    """`<req>_<stage>_<id>` → (req, stage, id); request ids may themselves contain `_`."""
    rest, _, chunk_id = key.rpartition("_")
    request_id, _, stage_id = rest.rpartition("_")
    return request_id, int(stage_id), int(chunk_id)


def stored_chunk_key(key: str, prefix: str = "") -> str:
    """The Redis name of chunk key `<req>_<stage>_<id>`: `<prefix>{<req>}_<stage>_<id>`,
    tagged by request so that a request's chunks and route keys share one slot."""
    rest, _, chunk_id = key.rpartition("_")
    request_id, _, stage_id = rest.rpartition("_")
    return f"{prefix}{hash_tag(request_id)}_{stage_id}_{chunk_id}"


def route_id(request_id: str, stage_id: int) -> str:
    """`<req>_<sender stage>`: the prefix shared by every chunk key of one request and stage."""
    return f"{request_id}_{stage_id}"


def route_of_chunk_key(key: str) -> str:
    """The route id (`<req>_<stage>`) of a chunk key `<req>_<stage>_<id>`."""
    return key.rpartition("_")[0]


def split_route_id(route: str) -> tuple[str, int]:
    """`<req>_<stage>` → (req, stage)."""
    request_id, _, stage_id = route.rpartition("_")
    return request_id, int(stage_id)


def chunk_route_key(route_id: str, prefix: str = "") -> str:
    """`route_id` is `<req>_<sender stage>`; the value names the receiver's wake-up list.
    Tagged like the request's chunk keys."""
    request_id, stage_id = split_route_id(route_id)
    return f"{prefix}route:{hash_tag(request_id)}_{stage_id}"


def receiver_notify_key(receiver_id: str, prefix: str = "") -> str:
    """A receiving connector's wake-up list: senders RPUSH to it after each put it listens to."""
    return f"{prefix}notify:{receiver_id}"


# --- control plane (Streams) ---------------------------------------------------

ORCHESTRATOR_GROUP = "orchestrator"
"""Consumer group the orchestrators read the requests and stage output streams with."""
ORCHESTRATOR_CONSUMER = "orchestrator"
"""The consumer name of orchestrator slot 0 in its groups (see `orchestrator_consumer`)."""
ORCHESTRATOR_LEASE_TTL_S = 5.0
"""An orchestrator slot whose lease is older than this is taken over by a live one."""
RELEASED_MAXLEN = 16
"""Notices kept on the released-slots stream (readers follow it live; a few suffice)."""
RELEASED_TTL_S = 3600
"""The released-slots stream expires this long after the last slot given up."""
MAX_SLOTS = 1024
"""Orchestrator slots are 0 .. MAX_SLOTS - 1 (a stage input names its owner slot)."""


def orchestrator_consumer(slot: int) -> str:
    """An orchestrator slot's consumer name: whoever holds the slot reads its backlog."""
    return ORCHESTRATOR_CONSUMER if slot == 0 else f"{ORCHESTRATOR_CONSUMER}-{slot}"


def control_group(slot: int) -> str:
    """An orchestrator slot's own group on the control stream (its consumer's name): every
    slot reads every abort, and the one that owns the request ends it."""
    return orchestrator_consumer(slot)


STATE_CHUNK_MARK = b"\xff"
"""Splits a chunk field of a slot's states hash from its request id: 0xFF never occurs in
UTF-8, so in no request id, and a field is either a request's state or one of its chunks."""


def state_chunk_field(request_id: str, stage_id: int, index: int) -> bytes:
    """The field of a slot's states hash holding chunk `index` of stage `stage_id`'s data
    kept for a request: `<request id>\\xff<stage>.<index>`."""
    return b"%s\xff%d.%d" % (request_id.encode(), stage_id, index)


def split_state_chunk_field(field: bytes) -> tuple[str, int, int] | None:
    """(request id, stage, index) of a chunk field; None for a state's field (a request id)
    or a field that is neither."""
    rid, mark, where = field.rpartition(STATE_CHUNK_MARK)
    stage, dot, index = where.partition(b".")
    if not mark or not dot or not stage.isdigit() or not index.isdigit():
        return None
    try:
        return rid.decode(), int(stage), int(index)
    except UnicodeDecodeError:
        return None


WORKERS_GROUP = "workers"
"""Consumer group the replicas of one stage share its input stream through."""
STREAM_MAXLEN = 100_000
"""Approximate MAXLEN every XADD trims to: bounded history, never an unbounded stream."""
CONTROL_STREAM_AGE_S = 60.0
"""Aborts older than this are trimmed from the control stream (XADD MINID): every worker
reads it as it comes, so an abort is useful only while a stalled worker may catch up."""
CLIENT_STREAM_TTL_S = 600
"""A client's output stream expires this long after its last write (client gone away)."""
HEARTBEAT_TTL_S = 5
"""A process whose heartbeat key is older than this is taken for dead."""
CLIENT_BUFFER_OUTPUTS = 4096
"""Outputs a client buffers for one request nobody reads before it aborts the request."""
RECENT_ABORTS_S = 60.0
"""How long a client remembers a request it ended itself, so late outputs drop quietly."""
DEAD_LETTER_MAXLEN = 10_000
TRACE_MAX_EVENTS = 10_000
"""A request's trace list is trimmed to this many stamps: a runaway stream stays bounded."""
RESPONSE_TTL_S = 3600
"""How long `serve` keeps a response for `previous_response_id` (`OMNI_RESPONSES_TTL_S`)."""
CONVERSATION_TTL_S = 30 * 24 * 3600
"""How long `serve` keeps a conversation after its last use (`OMNI_CONVERSATIONS_TTL_S`)."""
STATS_TTL_S = 30
"""A stats key outlives its writer by this long."""
PAYLOAD_FIELD = "m"
"""The one field of every stream entry: the msgpack-encoded wire message."""


class Names:
    """Every stream and key name of one namespace; namespaces isolate pipelines on one Redis."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.prefix = f"{namespace}:"

    @property
    def requests(self) -> str:
        return f"{self.prefix}requests"

    @property
    def control(self) -> str:
        """Broadcast control entries (aborts) every worker reads."""
        return f"{self.prefix}control"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}dead"

    def stage_in(self, stage_id: int) -> str:
        return f"{self.prefix}stage:{stage_id}:in"

    def stage_out(self, stage_id: int, slot: int = 0) -> str:
        """The outputs of a stage for the requests of one orchestrator slot (its owner);
        slot 0 keeps the plain name, so one orchestrator is laid out as it always was."""
        base = f"{self.prefix}stage:{stage_id}:out"
        return base if slot == 0 else f"{base}:{slot}"

    def client_out(self, client_id: str) -> str:
        return f"{self.prefix}client:{client_id}"

    def heartbeat(self, role: str) -> str:
        """`role` is "orchestrator" or "stage:<id>:<worker id>"."""
        return f"{self.prefix}hb:{role}"

    def orchestrator_heartbeat(self) -> str:
        """Shared by every orchestrator process (clients wait for one): the pipeline, its mode."""
        return self.heartbeat("orchestrator")

    def orchestrator_process_heartbeat(self, token: str) -> str:
        """One orchestrator process's own (`status`): its host, pid and requests."""
        return self.heartbeat(f"orchestrator:{token}")

    def stage_heartbeat(self, stage_id: int, worker_id: str) -> str:
        return self.heartbeat(f"stage:{stage_id}:{worker_id}")

    def ran_alone(self, stage_id: int, entry_id: bytes) -> str:
        """Set while a suspect input runs alone (`worker/isolation.py`)."""
        return f"{self.prefix}stage:{stage_id}:alone:{entry_id.decode()}"

    def worker_connection(self, stage_id: int, worker_id: str) -> str:
        """The client name every connection of a worker carries (a takeover closes them)."""
        return f"{self.prefix}worker:{stage_id}:{worker_id}"

    def client_heartbeat(self, client_id: str) -> str:
        return self.heartbeat(f"client:{client_id}")

    @property
    def _orchestrators(self) -> str:
        """The leases, take counters and registry share one tag: one lease round is one
        transaction over them all."""
        return f"{self.prefix}orch:{hash_tag('slots')}"

    def orchestrator_lease(self, slot: int) -> str:
        """Held (a token, with a TTL) by the orchestrator serving `slot`."""
        return f"{self._orchestrators}:lease:{slot}"

    def orchestrator_generation(self, slot: int) -> str:
        """Counts the takes of `slot` (no TTL): a holder whose lease vanished may take it
        back only if nobody took it in between (the count is still the one it got)."""
        return f"{self._orchestrators}:gen:{slot}"

    @property
    def orchestrator_slots(self) -> str:
        """A hash, every slot ever taken → its last holder's token: what live orchestrators
        watch for lapses, and whose connections a takeover closes."""
        return f"{self._orchestrators}:registry"

    @property
    def orchestrator_released(self) -> str:
        """A short stream: a slot number each time a process gives a slot up, so a live
        orchestrator takes it over at once instead of at its next lease round."""
        return f"{self._orchestrators}:released"

    def orchestrator_connection(self, token: str) -> str:
        """The client name of an orchestrator process's connections (CLIENT SETNAME)."""
        return f"{self.prefix}orch:{token}"

    def orchestrator_states(self, slot: int) -> str:
        """A hash: request id → durable routing state (msgpack) of each request in flight
        that `slot` owns, and one field per chunk of the stage data a state keeps
        (`state_chunk_field`); it expires 60 s after the latest deadline it holds."""
        return f"{self.prefix}orch:states:{slot}"

    @property
    def epoch(self) -> str:
        """A token with no TTL that vanishes only when Redis loses its data (empty restart);
        kept beside the heartbeats since it tells whether Redis's state is alive."""
        return self.heartbeat("epoch")

    def stage_stream_pattern(self) -> str:
        """Every stage's input and output stream (for SCAN)."""
        return f"{self.prefix}stage:*"

    def heartbeat_pattern(self, stage_id: int) -> str:
        return f"{self.prefix}hb:stage:{stage_id}:*"

    def trace(self, request_id: str) -> str:
        """A request's event stamps (a list of `event stage t_wall_ns`), with a TTL."""
        return f"{self.prefix}trace:{request_id}"

    def kept_response(self, response_id: str) -> str:
        """A response kept for `previous_response_id` (`http/response_store.py`), with a TTL."""
        return f"{self.prefix}response:{response_id}"

    def conversation(self, conversation_id: str) -> str:
        """A conversation (`http/response_store.py`): a list, its object then its items;
        with a TTL from its last use."""
        return f"{self.prefix}conversation:{conversation_id}"

    def background(self, response_id: str, part: str) -> str:
        """A background response's `lease`, its `end` (set once) or its `events` (a
        stream), beside the response kept (`http/background.py`)."""
        return f"{self.prefix}background:{response_id}:{part}"

    def stats(self, role: str) -> str:
        """A process's latest metrics summary (JSON), for `omni-runtime status`; with a TTL."""
        return f"{self.prefix}stats:{role}"

    @property
    def chunk_prefix(self) -> str:
        """Data-plane keys live under `<namespace>:chunk:` so one SCAN finds leftovers."""
        return f"{self.prefix}chunk:"
