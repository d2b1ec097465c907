"""bench.hotpath runs the real worker and appliance code in memory: it must keep running as
that code changes (a benchmark that rots measures nothing)."""

from __future__ import annotations

import math

import pytest

from reduction_appliance.bench import hotpath


def test_the_worker_path_completes_an_allreduce_in_memory() -> None:
    for per_wakeup in (1, hotpath.PER_WAKEUP):  # one result per turn, and the rack's shape
        us = hotpath.worker_us_per_segment(per_wakeup)
        assert math.isfinite(us) and us > 0


def test_the_appliance_path_reduces_every_datagram_in_memory() -> None:
    us = hotpath.appliance_us_per_datagram()
    assert math.isfinite(us) and us > 0


def test_wide_segments_run_through_both_paths_one_per_receive() -> None:
    assert math.isfinite(hotpath.worker_us_per_segment(segment=hotpath.WIDE_SEGMENT))
    assert math.isfinite(hotpath.appliance_us_per_datagram(segment=hotpath.WIDE_SEGMENT))


def test_main_prints_both_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert hotpath.main(["--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "us of Python per segment" in out and "us per datagram" in out
    assert "us per turn" in out
    assert f"segments of {hotpath.WIDE_SEGMENT} B" in out
