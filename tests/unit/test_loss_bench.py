"""bench.loss's plan and verdicts, and the timed-call count of the benches on shaped links, in
memory (their runs need the emulated rack)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import pytest

from reduction_appliance.bench import allreduce, loss
from reduction_appliance.bench.plan import MAX_TIMED_CALLS, SHAPED_TIMED_BYTES, SweepPlan
from reduction_appliance.bench.sweep import lossy_where
from tests.refusals import refusal

MIB = 1 << 20


def _plan(iters: int, min_timed_bytes: int) -> SweepPlan:
    return SweepPlan(network="rack", workers=(4,), rate="1gbit", sizes=(MIB,), dtypes=("fp32",),
                     ops=("sum",), modes=("multicast",), iters=iters, warmup=1, cores=2,
                     min_timed_bytes=min_timed_bytes)


@pytest.mark.parametrize("size, iters, expected", [
    (MIB, 3, 16),  # 16 MiB of timed calls: 13x the 1 Gbit/s shaper's bucket
    (2 * MIB, 3, 8),
    (3 * MIB, 3, 6),  # rounded up: at least the bytes asked for
    (64 * MIB, 3, 3),  # big enough already: `iters` rules
    (MIB, 20, 20),
    (1024, 3, MAX_TIMED_CALLS),  # latency-bound: the bucket lends nothing that matters
])
def test_small_cases_get_enough_timed_calls_to_spend_the_shapers_bucket(
        size: int, iters: int, expected: int) -> None:
    assert _plan(iters, SHAPED_TIMED_BYTES).iters_for(size) == expected
    assert _plan(iters, 0).iters_for(size) == iters  # the default: `iters` whatever the size


def test_the_loss_bench_times_its_cases_so() -> None:
    args = argparse.Namespace(workers=4, rate="1gbit", sizes=[MIB, 64 * MIB], iters=3, cores=2,
                              queue_target=0.025, lossy_ranks=None)
    plan = loss.plan_of(args)
    assert [plan.iters_for(size) for size in plan.sizes] == [16, 3]
    assert plan.lossy_ranks is None  # every worker's link
    assert loss.plan_of(argparse.Namespace(**{**vars(args), "lossy_ranks": (3,)})
                        ).lossy_ranks == (3,)
    lossy = dataclasses.replace(plan, loss_pct=5.0)  # each loss rate's plan: the same counts
    assert [lossy.iters_for(size) for size in lossy.sizes] == [16, 3]


def test_the_report_passes_a_target_only_when_the_median_repeat_meets_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    times = {(0.0, MIB): [0.010, 0.010, 0.012], (5.0, MIB): [0.080, 0.095, 0.150]}
    retx = {key: [0.1] for key in times}
    assert loss.report([0.0, 5.0], [MIB], times, retx)  # 0.010 / 0.095: 11% >= 10%
    assert "PASS >= 10% (worst repeat 7%)" in capsys.readouterr().out
    times[(5.0, MIB)] = [0.080, 0.105, 0.150]
    assert not loss.report([0.0, 5.0], [MIB], times, retx)  # 0.010 / 0.105: 10%, just under
    assert "FAIL >= 10%" in capsys.readouterr().out


def test_one_bad_cable_is_reported_unjudged(capsys: pytest.CaptureFixture[str]) -> None:
    times = {(0.0, MIB): [0.010], (5.0, MIB): [0.200]}  # 5%: far under the every-link target
    assert loss.report([0.0, 5.0], [MIB], times, {key: [0.1] for key in times}, targets={})
    out = capsys.readouterr().out
    assert "PASS" not in out and "FAIL" not in out
    row = next(line for line in out.splitlines() if line.lstrip().startswith("5%"))
    assert row.split("|")[2].strip() == "5%"  # the share of lossless, shown
    assert row.endswith("| -")  # and no verdict


def test_whose_links_lose_is_said_in_words() -> None:
    assert lossy_where(None) == ""
    assert lossy_where((3,)) == " on the link of rank 3 alone"
    assert lossy_where((1, 3)) == " on the links of ranks 1, 3 alone"


@pytest.mark.parametrize("program, argv, message", [
    (loss.main, ["--iters", "0"], "at least 1"),
    (loss.main, ["--repeat", "0"], "at least 1"),
    (loss.main, ["--queue-target", "-1"], "--queue-target"),
    (loss.main, ["--lossy-ranks", "4"], "names rank 4, but the rack's ranks are 0..3"),
    (loss.main, ["--workers", "8", "--lossy-ranks", "2,8"], "ranks are 0..7"),
    (loss.main, ["--lossy-ranks", "x"], "ranks are numbers, comma-separated"),
    (loss.main, ["--lossy-ranks", "-1"], "ranks count from 0"),
    (allreduce.main, ["--iters", "0"], "at least 1"),
    (allreduce.main, ["--repeat", "0"], "at least 1"),
    (allreduce.main, ["--warmup", "-1"], "at least 0"),
])
def test_bad_arguments_are_refused_with_the_reason(
        program: Callable[[list[str]], int], argv: list[str], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert message in refusal(program, argv, capsys)
