"""The real servers the tests run on, by the parameter name tests use for them."""

from __future__ import annotations

REAL_REDIS_FIXTURES = {
    "redis-server": "redis_url",
    "redis-cluster": "redis_cluster_url",
    "valkey": "valkey_test_url",
    "redis-sentinel": "redis_sentinel_url",
}
"""The flushed URL fixture (`tests/conftest.py`) of each real server kind."""
