"""Headless Chromium under Selenium for the playground tests, and their kept screenshots.

Needs Chromium and its driver (Debian: `apt-get install chromium chromium-driver`) and
selenium; without them a test is skipped, except under CI=true where it fails.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tests.e2e.serving import ROOT
from tests.services import unavailable

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACT_DIR = ROOT / "test-artifacts"


def _unavailable(reason: str) -> NoReturn:
    unavailable(reason, "Chromium")


@contextmanager
def chromium(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: Sequence[str] = ()
) -> Iterator[Any]:
    """A WebDriver for a fresh headless Chromium profile, with `flags` added to its own."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        _unavailable(
            f"{', '.join(missing)} not installed (apt-get install chromium chromium-driver)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install -e '.[test]')")
    monkeypatch.setenv("SE_OFFLINE", "true")  # never let Selenium Manager download anything
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--autoplay-policy=no-user-gesture-required",
        "--window-size=1000,900",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        *flags,
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def keep(browser: Any, tmp_path: Path, name: str) -> None:
    """A screenshot, kept under test-artifacts/."""
    shot = tmp_path / name
    assert browser.save_screenshot(str(shot))
    ARTIFACT_DIR.mkdir(exist_ok=True)
    shutil.copyfile(shot, ARTIFACT_DIR / name)
    assert shot.stat().st_size > 10_000
