"""The chunk plane (SPEC §4): the ChunkAdapter and the connectors it moves chunks through."""

from omni_runtime.chunks.memory import MemoryConnector
from omni_runtime.chunks.redis import RedisConnector

__all__ = ["MemoryConnector", "RedisConnector"]
