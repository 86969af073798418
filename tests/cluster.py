"""Run a whole pipeline in one process: the real service, worker and client classes.

Workers run on threads, the orchestrator on the test's event loop; they talk
only through the Redis the `RedisClients` point at (fakeredis or a real one).
"""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType
from typing import Any

from omni_runtime.client.client import OmniClient
from omni_runtime.core.types import OrchOutput
from omni_runtime.orchestrator.proc import OrchestratorService
from omni_runtime.pipeline import PipelineConfig
from omni_runtime.redis_io.clients import RedisClients
from omni_runtime.settings import Settings
from omni_runtime.worker.proc import StageWorker


class InProcessCluster:
    def __init__(
        self,
        pipeline: PipelineConfig,
        settings: Settings,
        clients: RedisClients,
        replicas: dict[int, int] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.clients = clients
        self.service = OrchestratorService(pipeline, settings, clients)
        self.workers = [
            StageWorker(pipeline, stage.id, settings, clients, worker_id=f"w{stage.id}-{r}")
            for stage in pipeline.stages[: pipeline.last_stage + 1]
            for r in range((replicas or {}).get(stage.id, 1))
        ]
        self._stop = asyncio.Event()
        self._threads: list[threading.Thread] = []

    async def __aenter__(self) -> InProcessCluster:
        self._service_task = asyncio.create_task(self.service.run(self._stop))
        for w in self.workers:
            t = threading.Thread(target=w.run, name=f"worker-{w.worker_id}", daemon=True)
            t.start()
            self._threads.append(t)
        self.client = OmniClient(self.settings, self.clients)
        await self.client.__aenter__()
        await self.client.wait_ready(list(range(self.pipeline.last_stage + 1)), timeout_s=20)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.client.close()
        for w in self.workers:
            w.stop()
        for t in self._threads:
            await asyncio.to_thread(t.join, 10)
        self._stop.set()
        done, _ = await asyncio.wait({self._service_task}, timeout=10)
        if not done:  # say where it hangs, then fail
            for task in asyncio.all_tasks():
                task.print_stack(limit=6)
            raise TimeoutError("orchestrator service did not stop within 10 s")
        self._service_task.result()

    async def run(self, prompt: Any, **kwargs: Any) -> list[OrchOutput]:
        return [out async for out in self.client.generate(prompt, **kwargs)]
