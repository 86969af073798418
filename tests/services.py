"""The one rule for a service a test needs and the machine lacks: fail under CI=true
(CI must install it), skip elsewhere."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"true", "1"}


def unavailable(reason: str, required: str) -> NoReturn:
    """`required`: what CI must provide, named in the failure."""
    if under_ci():
        pytest.fail(f"{reason}; {required} is required under CI=true", pytrace=False)
    pytest.skip(reason)
