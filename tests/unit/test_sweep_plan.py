"""The sweep's size parser and plan: ranges, lists, and usage errors (no root, no processes)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from reduction_appliance.bench.plan import (
    SweepPlan,
    add_sweep_arguments,
    parse_sizes,
    plan_from_args,
    unwritable_output,
)
from reduction_appliance.bench.report import bounds_gbps

KiB, MiB = 1 << 10, 1 << 20


def test_default_range_is_nccl_tests_like() -> None:
    assert parse_sizes("1KiB:256MiB:x4") == [KiB * 4**i for i in range(10)]


@pytest.mark.parametrize(("text", "want"), [
    ("4KiB,64KiB", [4 * KiB, 64 * KiB]),
    ("64KiB,4KiB,4KiB", [4 * KiB, 64 * KiB]),  # sorted, duplicates dropped
    ("64KiB:1MiB:+256KiB", [64 * KiB, 320 * KiB, 576 * KiB, 832 * KiB]),
    ("1KiB:16KiB:x4,1MiB", [KiB, 4 * KiB, 16 * KiB, MiB]),
    ("1KiB:1KiB:x2", [KiB]),
    ("1KiB:5KiB:x2", [KiB, 2 * KiB, 4 * KiB]),  # the stop need not be on the grid
    ("4096", [4096]),
])
def test_sizes(text: str, want: list[int]) -> None:
    assert parse_sizes(text) == want


@pytest.mark.parametrize("text", [
    "", ",", "0", "foo", "1KiB:2KiB", "2KiB:1KiB:x2", "1KiB:2KiB:x1", "1KiB:2KiB:y2",
    "1KiB:2KiB:+0", "1:1GiB:+1",
])
def test_bad_sizes_are_value_errors(text: str) -> None:
    with pytest.raises(ValueError):
        parse_sizes(text)


def _plan(*argv: str) -> SweepPlan:
    p = argparse.ArgumentParser()
    add_sweep_arguments(p)
    return plan_from_args(p.parse_args(list(argv)))


def test_plan_counts_every_pass_of_every_worker_count() -> None:
    plan = _plan("--workers", "8,4", "--sizes", "4KiB,64KiB", "--dtypes", "fp32,bf16",
                 "--modes", "multicast,unicast")
    assert plan.workers == (4, 8)
    assert plan.systems(multicast_possible=True) == ["multicast", "unicast", "ring"]
    assert plan.systems(multicast_possible=False) == ["unicast", "ring"]
    assert plan.total_cases(multicast_possible=True) == 2 * 3 * 2 * 2
    assert plan.rate_bps == 10**9


def test_loopback_plan_has_no_rate() -> None:
    assert _plan("--network", "loopback").rate is None


@pytest.mark.parametrize("argv", [
    ["--sizes", "1KiB:2KiB:x1"], ["--workers", "1"], ["--modes", "broadcast"],
    ["--dtypes", "fp64"], ["--rate", "fast"],
    ["--workers", "4,155"],  # beyond the rack's /24: was a ValueError traceback from the lab
])
def test_bad_options_are_usage_errors(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    add_sweep_arguments(p)
    with pytest.raises(SystemExit) as exc:
        p.parse_args(argv)
    assert exc.value.code == 2


def test_an_appliance_rate_shapes_the_appliance_link_and_bounds_the_server() -> None:
    p = argparse.ArgumentParser()
    add_sweep_arguments(p)
    plan = plan_from_args(p.parse_args(["--workers", "8", "--rate", "500mbit",
                                        "--appliance-rate", "1gbit"]))
    assert plan.appliance_rate == "1gbit" and plan.appliance_rate_bps == 10**9
    # Eight workers' contributions cross one 1 Gbit/s link: 1/8 of it each, not 500 Mbit/s.
    assert bounds_gbps(500 * 10**6, 8, plan.appliance_rate_bps)["reduction server"] == \
        pytest.approx(10**9 / 8 / 1e9 / 8)
    assert bounds_gbps(500 * 10**6, 8)["reduction server"] == pytest.approx(0.0625)
    unshaped = plan_from_args(p.parse_args([]))
    assert unshaped.appliance_rate is None and unshaped.appliance_rate_bps is None
    with pytest.raises(SystemExit):
        p.parse_args(["--appliance-rate", "fast"])


def test_slots_reach_the_plan_and_must_be_positive() -> None:
    p = argparse.ArgumentParser()
    add_sweep_arguments(p)
    assert plan_from_args(p.parse_args([])).slots == 32  # the appliance's default jobs.slots
    assert plan_from_args(p.parse_args(["--slots", "16"])).slots == 16
    with pytest.raises(ValueError, match="--slots >= 1"):
        plan_from_args(p.parse_args(["--slots", "0"]))


def test_where_results_cannot_go_is_said_before_the_run(tmp_path: Path) -> None:
    """`--out /proc/x` failed with a traceback once every case had run."""
    assert unwritable_output(None, directory=True) is None
    assert unwritable_output(tmp_path / "new" / "dir", directory=True) is None
    assert (tmp_path / "new" / "dir").is_dir()  # made now
    assert unwritable_output(tmp_path / "a" / "rows.json", directory=False) is None
    assert unwritable_output(tmp_path, directory=False) == (
        f"{tmp_path} is a directory: give a file name for the results")
    assert unwritable_output(Path("/proc/x"), directory=True) == (
        "cannot write results under /proc/x: No such file or directory")
    (tmp_path / "file").write_text("")
    assert "cannot write results under" in str(
        unwritable_output(tmp_path / "file" / "rows.json", directory=False))
