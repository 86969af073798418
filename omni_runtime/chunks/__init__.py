"""The chunk plane (SPEC §4): the ChunkAdapter and the transports it moves chunks through."""

from omni_runtime.chunks.memory import MemoryConnector
from omni_runtime.chunks.redis import RedisConnector
from omni_runtime.chunks.transport import ChunkTransport, Connector, PollingTransport

__all__ = [
    "ChunkTransport",
    "Connector",
    "MemoryConnector",
    "PollingTransport",
    "RedisConnector",
]
