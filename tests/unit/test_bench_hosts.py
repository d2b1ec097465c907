"""bench.hosts: a run's figure from its ranks, the side-by-side speedups, the report and the
refusals, with made-up reports (the benchmark itself needs root and a rack)."""

from __future__ import annotations

import pytest

from reduction_appliance.bench.hosts import Plan, format_report, one_run, parse_args, summarize


def test_a_runs_figure_is_the_median_over_calls_of_the_slowest_rank() -> None:
    ranks = [{"times": [0.10, 0.30, 0.20], "ok": True, "staged": True},
             {"times": [0.15, 0.10, 0.25], "ok": True, "staged": True}]
    run = one_run(ranks)
    assert run["calls_s"] == [0.15, 0.30, 0.25] and run["median_s"] == 0.25
    assert run["ok"] and run["staged"] == [True]
    ranks[1]["ok"] = False
    assert not one_run(ranks)["ok"]


def _runs() -> list[dict[str, object]]:
    medians = {("gloo", 0): 1.0, ("staged", 0): 0.8, ("flat", 0): 2.0,
               ("gloo", 1): 1.2, ("staged", 1): 0.8, ("flat", 1): 2.4,
               ("gloo", 2): 0.9, ("staged", 2): 0.9, ("flat", 2): 1.8}
    return [{"mode": m, "repeat": r, "median_s": t, "ok": True, "staged": [m == "staged"]}
            for (m, r), t in medians.items()]


def test_speedups_are_taken_repeat_by_repeat_against_gloo() -> None:
    summary = summarize(_runs())
    assert summary["staged"]["speedups"] == pytest.approx([1.25, 1.5, 1.0])
    assert summary["staged"]["speedup_median"] == pytest.approx(1.25)
    assert summary["staged"]["speedup_range"] == pytest.approx((1.0, 1.5))
    assert summary["flat"]["speedup_median"] == pytest.approx(0.5)
    assert "speedups" not in summary["gloo"]


def test_the_report_gives_each_mode_its_repeats_and_speedup() -> None:
    plan = Plan(hosts=2, ranks_per_host=4, rate="1gbit", size=64 << 20, iters=5, warmup=2,
                repeat=3, cores=2)
    text = format_report(plan, _runs())
    assert "64 MiB fp32 on 2 hosts x 4 ranks, host links 1gbit" in text
    staged = next(line for line in text.splitlines() if line.startswith("staged "))
    assert "800, 800, 900" in staged and "1.25x (1.00-1.50): 1.25, 1.50, 1.00" in staged
    assert staged.endswith("yes")


@pytest.mark.parametrize("argv, words", [
    (["--ranks-per-host", "1"], "--ranks-per-host >= 2"),
    (["--hosts", "1"], "--hosts >= 2"),
    (["--size", "6"], "whole number of fp32 elements"),
    (["--size", "lots"], "bad size 'lots'"),
    (["--rate", "fast"], "fast"),
    (["--repeat", "0"], "--repeat >= 1"),
])
def test_bad_arguments_are_refused_with_the_reason(argv: list[str], words: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


def test_the_defaults_are_two_hosts_of_four_at_one_gigabit() -> None:
    plan, out = parse_args([])
    assert (plan.hosts, plan.ranks_per_host, plan.world, plan.rate, plan.size) == \
        (2, 4, 8, "1gbit", 64 << 20) and out is None
