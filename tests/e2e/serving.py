"""`omni-runtime serve` as a real process on a free loopback port, for end-to-end tests
(`benchmarks.harness.serve`, which the benchmarks use too)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.serve import ServeProcess
from omni_runtime.local.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]

__all__ = ["ROOT", "ServeProcess", "free_port"]
