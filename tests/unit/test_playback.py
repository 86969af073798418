"""Playback gaps from arrival times: the listener's clock, with made-up times."""

from __future__ import annotations

import numpy as np
import pytest

from omni_runtime.client.playback import AUDIBLE_GAP_S, Continuity, Playback, audio_seconds


def test_chunks_arriving_before_the_buffer_runs_dry_play_without_a_gap() -> None:
    p = Playback()
    assert p.add(10.0, 0.1) == 0.0  # plays 10.0-10.1
    assert p.add(10.05, 0.1) == 0.0  # queued: plays 10.1-10.2
    assert p.add(10.2, 0.1) == 0.0  # arrives exactly as the buffer runs out
    assert p.plays_until == pytest.approx(10.3)
    assert p.gaps == [] and p.worst_gap_s == 0.0 and p.stall_s == 0.0 and p.continuous
    assert p.audio_s == pytest.approx(0.3)


def test_a_late_chunk_is_a_gap_and_playback_resumes_when_it_arrives() -> None:
    p = Playback()
    p.add(1.0, 0.1)  # plays until 1.1
    assert p.add(1.35, 0.2) == pytest.approx(0.25)  # silence 1.1-1.35, then plays to 1.55
    assert p.plays_until == pytest.approx(1.55)
    assert p.add(1.6, 0.05) == pytest.approx(0.05)
    assert p.add(1.6, 1.0) == 0.0  # queued behind the previous one
    assert p.gaps == pytest.approx([0.25, 0.05])
    assert p.worst_gap_s == pytest.approx(0.25)
    assert p.stall_s == pytest.approx(0.30)
    assert not p.continuous


def test_a_buffer_built_up_early_absorbs_a_later_delay() -> None:
    p = Playback()
    p.add(0.0, 2.0)  # two seconds at once: plays until 2.0
    assert p.add(1.9, 0.02) == 0.0  # 1.9 s after the first chunk, still no gap
    assert p.add(2.1, 0.02) == pytest.approx(0.08)  # plays_until was 2.02
    assert p.continuous  # 80 ms: under the audible limit


def test_empty_chunks_neither_start_playback_nor_end_a_gap() -> None:
    p = Playback()
    assert p.add(0.0, 0.0) == 0.0
    assert p.started_at is None
    p.add(1.0, 0.1)
    assert p.started_at == 1.0
    assert p.add(5.0, 0.0) == 0.0  # the stage's empty final array: nothing to hear
    assert p.gaps == []


def test_audio_seconds_counts_samples_of_arrays_only() -> None:
    assert audio_seconds(np.zeros(320, dtype=np.float32), 16000) == pytest.approx(0.02)
    assert audio_seconds(np.zeros(0, dtype=np.float32), 16000) == 0.0
    assert audio_seconds("text", 16000) == 0.0
    assert audio_seconds(None, 16000) == 0.0
    assert audio_seconds([0.0] * 320, 16000) == 0.0  # not PCM as the runtime carries it


def test_continuity_over_a_run() -> None:
    smooth = Playback()
    smooth.add(0.0, 1.0)
    smooth.add(0.5, 1.0)
    edge = Playback()
    edge.add(0.0, 0.1)
    edge.add(0.1 + AUDIBLE_GAP_S, 0.1)  # exactly the limit: still continuous
    broken = Playback()
    broken.add(0.0, 0.1)
    broken.add(0.5, 0.1)  # 0.4 s gap
    broken.add(1.0, 0.1)  # 0.4 s gap again
    silent = Playback()  # a request with no audio: not a listener's experience
    c = Continuity.of([smooth, edge, broken, silent])
    assert c.requests == 3
    assert c.continuous_share == pytest.approx(2 / 3)
    assert c.worst_gap_p50_s == pytest.approx(AUDIBLE_GAP_S)
    assert c.worst_gap_p99_s == pytest.approx(0.4)
    assert c.stall_s == pytest.approx(AUDIBLE_GAP_S + 0.8)


def test_continuity_of_no_requests_is_vacuous() -> None:
    c = Continuity.of([])
    assert (c.requests, c.continuous_share, c.worst_gap_p99_s, c.stall_s) == (0, 1.0, 0.0, 0.0)
