"""A stage worker process: the shell around a `WorkerCore`; it alone owns Redis clients (their
connections named for it) and threads: input, control, heartbeat (and takeovers), output and,
streaming, the ChunkAdapter's. Its loop never blocks on Redis: hand the core what the threads
delivered, step the engine, carry out the core's actions, sleep until woken. For a function
stage, a thread that delivers work runs that pass itself when the loop is idle (`turn`).
The loop and the reading threads report their progress to a watchdog (`watchdog`)."""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from omni_runtime import keys
from omni_runtime.chunks.adapter import ChunkAdapter
from omni_runtime.chunks.redis import RedisConnector
from omni_runtime.observe.probes import Probes
from omni_runtime.observe.start import Observability, ObserveSettings
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.redis_io.backoff import RetrySettings
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.redis_io.mode_check import check_worker_mode
from omni_runtime.redis_io.streams import SyncGroupReader, ensure_group_sync
from omni_runtime.settings import Settings
from omni_runtime.stage_api import EngineDead
from omni_runtime.watchdog import Progress, Stuck, Watchdog
from omni_runtime.wire import codec
from omni_runtime.wire.views import StageInputView
from omni_runtime.worker.actions import Actions, Input, Outgoing
from omni_runtime.worker.async_engine import AsyncEngineDriver
from omni_runtime.worker.core import WorkerCore
from omni_runtime.worker.engines import GeneratorEngine, engine_factory, load_engine
from omni_runtime.worker.fence import StallGuard
from omni_runtime.worker.handback import hand_back
from omni_runtime.worker.io_threads import (
    ControlThread,
    Handoff,
    InputThread,
    ReaderSettings,
    Slots,
)
from omni_runtime.worker.isolation import Isolation
from omni_runtime.worker.observed import WorkerObservation
from omni_runtime.worker.output import OutputThread
from omni_runtime.worker.takeover import Takeover, TakeoverSettings, name_connections
from omni_runtime.worker.turn import LoopTurn

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL_S = 0.05
"""How often the loop checks for stalled inputs, at the latest."""
IDLE_LOOP_WAIT_S = 1.0
"""With no request in flight the loop sleeps until woken (inputs, aborts), at most this long."""
JOIN_TIMEOUT_S = 5.0


class StageWorker:
    def __init__(
        self,
        pipeline: PipelineConfig,
        stage_id: int,
        settings: Settings,
        clients: RedisClients | None = None,
        worker_id: str | None = None,
        replaces: str | None = None,
    ) -> None:
        s = settings
        self.pipeline = pipeline
        self.stage = pipeline.stage(stage_id)
        self.stage_id = stage_id
        self.settings = settings
        self.clients = clients or RedisClients.connect(s.redis_url, s.redis_cluster, s.namespace)
        self.names = s.names
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.streaming = pipeline.mode == "streaming"
        self.sends_chunks = self.streaming and stage_id < pipeline.last_stage
        self.receives_chunks = self.streaming and stage_id > 0
        self.in_stream = self.names.stage_in(stage_id)
        self.out_stream = self.names.stage_out(stage_id)
        self.obs = Observability()
        """Handed to the parts that count or stamp; started by `run`."""
        self.metrics = self.obs.metrics
        observe = s.part(ObserveSettings)
        self.observed = WorkerObservation(
            self.obs, stage_id, self.worker_id, self.in_stream, observe, s.worker_max_concurrency
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stop_now = False
        self._drain_deadline: float | None = None
        self._drained = False
        self._serving = False
        """Registered (first heartbeat written, engine started) and not draining: `/ready`."""
        self._input_stop = threading.Event()
        self._turn = LoopTurn(self._pass_elsewhere, self._wake)
        self._waits_long = True  # the loop's last pass left none in flight: it sleeps long
        self._inputs: Handoff[Input] = Handoff(self._turn.deliver)
        self._aborts: Handoff[str] = Handoff(self._turn.deliver)
        self._lost: Handoff[tuple[list[Outgoing], str]] = Handoff(self._wake.set)
        self._slots = Slots(s.worker_max_concurrency)
        self._in_flight = 0
        """The core's count, published by the loop for other threads (one int store)."""
        self._progress = Progress(
            f"stage {stage_id}'s scheduler loop",
            lambda: self._in_flight > 0 or self._inputs.waiting or self._aborts.waiting,
        )
        self._watchdog: Watchdog | None = None
        self._client = self.clients.sync()
        name_connections(self._client, self.names, stage_id, self.worker_id)
        self._isolation = Isolation(self._client, self.names, self._slots, stage_id, self.metrics)
        ended = self._turn.deliver  # a stage call's last output: its pass runs there
        self._engine_dead: str | None = None
        self.engine = load_engine(self.stage, pipeline.source_dir, s.worker_max_concurrency,
                                  self._wake.set, ended, self._turn.defer,
                                  s.worker_quick_call_ms / 1000, on_dead=self._engine_died,
                                  start_timeout_s=s.engine_start_timeout_s,
                                  health_interval_s=s.engine_health_interval_s)  # fmt: skip
        self._turn.shared = isinstance(self.engine, GeneratorEngine)
        self._async = self.engine if isinstance(self.engine, AsyncEngineDriver) else None
        if self._async is not None:
            self.observed.watch_engine(self._async.stats)
        self.core = WorkerCore(
            self.engine,
            stage_id,
            self.stage.name,
            sends_chunks=self.sends_chunks,
            final_stage_ids=frozenset(pipeline.final_stage_ids),
            audio_stage=pipeline.audio_stage,
            receives_chunks=self.receives_chunks,
            max_message_bytes=s.max_message_bytes,
            input_timeout_s=s.input_timeout_s,
            metrics=self.metrics,
            reports_outputs=not self.sends_chunks or stage_id in pipeline.final_stage_ids,
            rebuild=engine_factory(self.stage, pipeline.source_dir),
            poison_strikes=s.worker_poison_strikes,
        )
        self._connector: RedisConnector | None = None
        self.adapter: ChunkAdapter | None = None  # streaming only: built (and started) in `run`
        retry = s.part(RetrySettings)
        reading = s.part(ReaderSettings, retry=retry)
        reader = functools.partial(
            SyncGroupReader[StageInputView],
            self._client,
            self.in_stream,
            keys.WORKERS_GROUP,
            self.worker_id,
            StageInputView,
            max_bytes=s.max_message_bytes,
            dead_letters=self.names.dead_letters,
            metrics=self.metrics,
            backoff=retry.backoff(bounded=True),
        )
        self._control = ControlThread(
            self._client, self.names.control, self._aborts.put, reading, self.metrics
        )
        ttl_s = s.heartbeat_ttl_ms / 1000
        self._guard = StallGuard(self._client, self.in_stream, self.worker_id, ttl_s, self._wake)
        self._takeover = Takeover(
            self._client, reader(), self._take_over, s.part(TakeoverSettings, retry=retry),
            worker_id=self.worker_id, stage_id=stage_id, metrics=self.metrics, replaces=replaces,
        )  # fmt: skip
        self._heartbeat = self._takeover.heartbeat(self.status, self._guard)
        self._input = InputThread(
            reader(stop=self._input_stop),
            self._slots,
            self._inputs.put,
            reading,
            stage_id=stage_id,
            obs=self.obs,
            stop=self._input_stop,
            redelivery=self._takeover.redelivery,
        )
        self._output = OutputThread(
            self._client,
            self.out_stream,
            self.in_stream,
            maxlen=s.stream_maxlen,
            backoff=functools.partial(retry.backoff, bounded=True),
            on_lost=lambda outs, reason: self._lost.put([(outs, reason)]),
            metrics=self.metrics,
            fence=self._guard.fence,
            slot_stream=functools.partial(self.names.stage_out, stage_id),
            max_batch_bytes=s.max_message_bytes,
        )

    def run(self) -> None:
        """Serve until `stop()`; then finish in-flight requests for a short while and exit."""
        s = self.settings
        check_worker_mode(self._client, self.names, self.pipeline)  # before a model loads
        codec.warm_up()
        if self._async is not None:  # loaded before the first input is read
            self._async.start()
        ensure_group_sync(self._client, self.in_stream, keys.WORKERS_GROUP)
        if self.streaming:
            self._connector = RedisConnector(
                self._client,
                ttl_s=s.chunk_ttl_s,
                prefix=self.names.chunk_prefix,
                max_bytes=s.max_message_bytes,
            )
            self.adapter = ChunkAdapter(
                self._connector, self.stage_id, on_ready=self._turn.deliver, metrics=self.metrics
            )
        self.observed.start(self.clients.sync, Probes(ready=self._not_ready))
        self._takeover.redelivery.remember_previous_life(self.worker_id)  # before any claim
        self._control.start()  # before any input, taken over or read: aborts come first
        self._heartbeat.start()  # first: the stage is never without a live replica's key
        self._takeover.replace()  # between the replaced one's (deleted here) and this one's
        self._output.start()
        self._input.start()
        self._start_watchdog()
        self._serving = True
        log.info("worker %s of stage %d (%s) ready", self.worker_id, self.stage_id, self.stage.name)
        try:
            self._loop()
        finally:
            self._shut_down()

    def _start_watchdog(self) -> None:
        """The scheduler loop is watched while it has requests in flight (or inputs handed
        over); the reading threads, which wait on Redis alone, all along, with the longest
        Redis retry on top of the limit."""
        s = self.settings
        if s.watchdog_s <= 0:
            return
        self._watchdog = Watchdog(s.watchdog_s, self._give_back)
        self._watchdog.watch(self._progress)
        for thread in (self._input, self._control, self._heartbeat):
            self._watchdog.watch(thread.progress)  # each allowed its Redis retries (`slack_s`)
        self._watchdog.start()

    def _give_back(self, _stuck: list[Stuck]) -> None:
        """The watchdog's last act: the heartbeat goes now, so a live replica takes over."""
        self._heartbeat.request_stop()
        self._heartbeat.forget()

    def _not_ready(self) -> str | None:
        """`/ready`: why this worker takes no input now, or None."""
        if self._engine_dead is not None:
            return f"engine unhealthy: {self._engine_dead}"
        if self._stop.is_set():
            return "draining"
        return None if self._serving else "starting"

    def stop(self) -> None:
        """Stop reading inputs and drain for `OMNI_DRAIN_S` (what is left is then handed back);
        again, stop without draining (a second Ctrl-C). Any thread may call it (`signals.py`)."""
        self._serving = False
        self._stop_now = self._stop.is_set()
        self._stop.set()
        self._input_stop.set()
        self._wake.set()

    def status(self) -> dict[str, Any]:
        """The heartbeat's value: who this worker is and what it has done."""
        return self.observed.status(self._in_flight) | {"mode": self.pipeline.mode}

    @property
    def active(self) -> int:
        """Requests in flight on this worker."""
        return self._in_flight

    def _loop(self) -> None:
        drain_deadline: float | None = None
        next_housekeeping = 0.0
        turn = self._turn
        while True:
            # Cleared before the stop check and the pass: a stop, or work handed over while
            # the lock is held, from here on wakes the wait below (cleared between the check
            # and the pass, a stop was lost for an idle wait: Ctrl-C of `run` took 1.04 s).
            self._wake.clear()
            now = time.monotonic()
            if self._stop.is_set():
                if drain_deadline is None:  # end the input read now: a draining worker reads none
                    self._input.request_stop()
                drain_deadline = drain_deadline or now + self.settings.drain_s
                self._drain_deadline = drain_deadline
                if not self.core.in_flight or now > drain_deadline or self._stop_now:
                    self._drained = True  # what is left goes back (not on a failure: below)
                    return
            with turn.lock:
                if turn.failure is not None:
                    raise turn.failure
                if self._engine_dead is not None:  # out of service: inputs go to a live replica
                    raise EngineDead(f"stage {self.stage_id} engine: {self._engine_dead}")
                housekeeping = now >= next_housekeeping
                if housekeeping:
                    next_housekeeping = now + HOUSEKEEPING_INTERVAL_S
                busy = self._pass(now, housekeeping)
                self._waits_long = not self.core.in_flight
            if not busy:
                self._wake.wait(IDLE_LOOP_WAIT_S if self._waits_long else HOUSEKEEPING_INTERVAL_S)

    def _pass(self, now: float, housekeeping: bool) -> bool:
        """One pass of the loop (under `turn.lock`); True if it did work."""
        self._progress.beat()
        busy = self._feed(now)
        busy |= self.core.step()
        if housekeeping:
            self.core.tick(now)
        self._apply(self.core.take_actions())
        return busy

    def _pass_elsewhere(self) -> None:
        """A pass on the thread that delivered work (`LoopTurn`). A loop asleep for long is
        woken if a request it must watch for stalled chunks came in (its housekeeping)."""
        self._pass(time.monotonic(), housekeeping=False)
        if self._waits_long and self.receives_chunks and self.core.in_flight:
            self._wake.set()

    def _feed(self, now: float) -> bool:
        """What the threads delivered, aborts first (never older than what they abort)."""
        core = self.core
        aborts, lost = self._aborts.take(), self._lost.take()
        inputs = self._isolation.admit(self._inputs.take(), core.in_flight)  # suspects alone
        for rid in aborts:
            core.on_abort(rid, now)
        self.observed.aborted(aborts)
        self.observed.inputs(inputs)
        self._output.route(inputs)
        for inp in inputs:
            core.on_input(inp, now)
        for outs, reason in lost:
            core.on_publish_failed(outs, reason)
        checked = self._guard.apply(core.on_ownership, self._output.forget)
        ready = self.adapter.poll_ready() if self.adapter and self.receives_chunks else {}
        return core.on_chunks(ready, now) or bool(aborts or inputs or lost or checked)

    def _apply(self, actions: Actions) -> None:
        """Writes go to the output thread first; chunks after (the user's output leads)."""
        self._output.publish(actions.outputs, actions.acks)
        self.observed.published(actions)
        adapter = self.adapter
        if adapter is not None:  # a request may start and end within one batch: in that order
            for rid in actions.receiver_loads:
                adapter.load_async(rid)
            for rid, data, finished in actions.chunk_saves:
                adapter.save_async(rid, data, finished)
            for rid in actions.discards:
                adapter.discard(rid)
            for rid in actions.receiver_cleanups:
                adapter.cleanup_receiver(rid)
        self._in_flight = self.core.in_flight
        self._slots.give_back(actions.freed_slots)

    def _hand_back(self) -> None:
        """What the drain left unfinished, and inputs read but never started, go back to the
        stream for a live replica now (`handback.py`); once the output thread has written
        all it had, so this worker publishes nothing for them afterwards. Not when the loop
        failed or the engine died: those inputs stay pending for a takeover, which counts
        their deliveries (an input that kills engines is dead-lettered, not passed on)."""
        if not self._drained:
            return
        unstarted = [i.entry_id for i in self._inputs.take() if not i.solo]  # suspects: pending
        held = self.core.held_entries() + unstarted + self._isolation.held()
        if held:
            n = hand_back(self._client, self.in_stream, held, self.settings.stream_maxlen)
            log.warning("drain deadline: %d of %d unfinished input(s) handed back", n, len(held))

    def _engine_died(self, reason: str) -> None:
        """Leave service: read no more input and exit, unacked, so that another replica
        takes this one's inputs over (`takeover.py`) once its heartbeat is gone."""
        self._engine_dead = reason
        self._input_stop.set()
        self._wake.set()

    def _take_over(self, inputs: list[Input]) -> None:
        self._slots.force_take(len(inputs))
        self._inputs.put(inputs)

    def _shut_down(self) -> None:
        """Signal every thread, then join them all: one wait, not one per thread."""
        if self._watchdog is not None:
            self._watchdog.stop()
        self._turn.close()
        threads = (self._input, self._control, self._heartbeat, self._output)
        for t in threads:
            t.request_stop()
        if self.adapter is not None:
            self.adapter.stop()
        for t in threads:
            t.join(JOIN_TIMEOUT_S)
        self._hand_back()
        self._heartbeat.forget()
        engine = self.core.engine
        if isinstance(engine, GeneratorEngine) and self._drain_deadline is not None:
            left = max(0.0, self._drain_deadline - time.monotonic())  # exit within the drain
            engine.close_grace_s = min(engine.close_grace_s, left)
        if self._connector is not None:
            self._connector.close()
        self.core.driver.close()
        self.observed.close()
        self._client.close()
        counts = [f"{k}={v}" for k, v in self.status().items() if isinstance(v, int) and k != "pid"]
        log.info("worker %s stopped: %s", self.worker_id, " ".join(counts))
