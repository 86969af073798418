"""Fixtures more than one end-to-end module uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.realtime_deployment import Deployment, demo_deployment


@pytest.fixture(scope="module")
def demo(redis_server_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The synthetic demo (streaming) with `serve` in front, for `/v1/realtime` tests."""
    yield from demo_deployment(redis_server_url, tmp_path_factory)
