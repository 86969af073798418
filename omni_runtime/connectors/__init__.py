"""Connectors: the ChunkAdapter's data plane (`put`, consume-once `get`), in memory or on Redis."""

from omni_runtime.connectors.memory import MemoryConnector
from omni_runtime.connectors.redis import RedisConnector

__all__ = ["MemoryConnector", "RedisConnector"]
