"""The sweep's progress bar: pure formatting, and what it writes to a log (no terminal)."""

from __future__ import annotations

import io

from reduction_appliance.bench.progress import ProgressBar, format_bar, format_duration


def test_durations() -> None:
    assert [format_duration(s) for s in (0, 59.4, 61, 3599, 3600, 7322)] == [
        "0:00", "0:59", "1:01", "59:59", "1:00:00", "2:02:02"]


def test_bar_before_the_first_case_has_no_eta() -> None:
    assert format_bar(0, 12, 3.0, width=12) == (
        "[............]  0/12 cases  elapsed 0:03  ETA ?")


def test_bar_extrapolates_the_mean_case_time() -> None:
    # 3 of 12 cases in 30 s: 9 left at 10 s each.
    assert format_bar(3, 12, 30.0, "n=4 gloo", width=12) == (
        "[###.........]  3/12 cases  elapsed 0:30  ETA 1:30  n=4 gloo")


def test_bar_is_clamped() -> None:
    assert format_bar(15, 12, 60.0, width=4).startswith("[####] 12/12 cases")
    assert format_bar(0, 0, 0.0, width=4).startswith("[....] 0/1 cases")


def test_a_log_gets_one_line_per_finished_case() -> None:
    out = io.StringIO()
    bar = ProgressBar(2, stream=out)
    bar.update(label="case 1")
    bar.update(label="case 1 still")  # no new line: nothing finished
    bar.advance()
    bar.update(label="case 2")
    bar.advance()
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" cases")[0].split("] ")[1] for line in lines] == ["0/2", "1/2", "2/2"]
    assert "\r" not in out.getvalue()
