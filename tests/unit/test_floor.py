"""bench.floor's arithmetic and arguments, and its peer's, in memory (the runs: tests/netns)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from reduction_appliance.bench import floor, floor_peer, floor_plot
from reduction_appliance.deploy.testnet.probe import MachineTime
from tests.refusals import refusal


def test_the_floor_moves_whole_segments_never_more_than_the_size() -> None:
    assert floor.floor_segments(64 * 2**20, 8896) == 7543  # 7543.x: the part is left out
    assert floor.floor_segments(8896, 8896) == 1
    with pytest.raises(ValueError, match="less than one segment"):
        floor.floor_segments(8895, 8896)


def test_bounds_are_gloo_against_the_floor_and_against_the_kernel_over_every_cpu() -> None:
    got = floor.bounds(gloo_s=0.3, floor_s=0.6, kernel_s_per_iter=0.5, cpus=2)
    assert got["floor_ratio"] == pytest.approx(0.5)
    assert got["kernel_bound_s"] == pytest.approx(0.25)  # 0.5 CPU-seconds over two CPUs
    assert got["kernel_ratio"] == pytest.approx(1.2)
    assert floor.bounds(0.3, 0.6, 0.0, 2)["kernel_ratio"] == float("inf")
    for bad in ((0.0, 0.6, 0.5, 2), (0.3, 0.0, 0.5, 2), (0.3, 0.6, 0.5, 0)):
        with pytest.raises(ValueError):
            floor.bounds(*bad)


def _row(floor_ratio: float, kernel_ratio: float, appliance_ratio: float | None = None
         ) -> dict[str, object]:
    return {"floor_ratio": floor_ratio, "kernel_ratio": kernel_ratio,
            **({"appliance_ratio": appliance_ratio} if appliance_ratio else {})}


def test_the_summary_gives_each_ratio_as_median_range_and_every_run() -> None:
    text = floor.summary([_row(0.4, 1.2, 0.3), _row(0.5, 1.0, 0.35), _row(0.3, 1.4, 0.25)])
    assert "over 3 runs" in text
    assert "gloo/appliance: 0.30x (0.25-0.35; runs 0.30x, 0.35x, 0.25x)" in text
    assert "gloo/floor: 0.40x (0.30-0.50; runs 0.40x, 0.50x, 0.30x)" in text
    assert "1.20x (1.00-1.40; runs 1.20x, 1.00x, 1.40x)" in text
    # --no-appliance: no appliance line
    assert "gloo/appliance" not in floor.summary([_row(0.4, 1.2), _row(0.5, 1.0)])


def test_a_run_line_says_each_system_and_the_kernel_bound() -> None:
    row = {"floor_time_s": 0.6, "floor_link_util": 0.07, "results_per_receive": 6.3,
           "segments_per_send": 6.4, "gloo": {"time_s": 0.3}, "floor_ratio": 0.5,
           "floor_kernel_s": 0.5, "floor_user_s": 0.7, "kernel_bound_s": 0.25,
           "kernel_ratio": 1.2, "appliance": {"time_s": 0.8, "worker_cpu_s_per_gb": 4.57,
                                              "worker_kernel_cpu_s_per_gb": 1.9},
           "appliance_ratio": 0.375, "appliance_of_floor": 0.75,
           "floor_worker_cpu_s_per_gb": 1.234, "floor_worker_kernel_cpu_s_per_gb": 0.81}
    line = floor.format_run(2, row)
    for part in ("run 2: gloo ring 300.0 ms | the appliance 800.0 ms (gloo/appliance 0.38x, "
                 "75% of the floor's speed; a worker's CPU 4.57 s per GB (1.90 s of it kernel)) | "
                 "floor 600.0 ms, "
                 "7% of a worker's link",
                 "6.3 results per receive", "6.4 segments per send; a worker's CPU 1.23 s per "
                 "GB (0.81 s of it kernel) (gloo/floor 0.50x)",
                 "kernel 0.500 s, user 0.700 s", "for 250.0 ms: gloo/that 1.20x"):
        assert part in line, line
    row |= {"appliance": None}  # --no-appliance
    del row["floor_link_util"]  # loopback: no link of a worker's own
    del row["floor_worker_kernel_cpu_s_per_gb"]  # a row of a run before the kernel's part
    line = floor.format_run(1, row)
    assert "link" not in line and "appliance" not in line, line
    assert "a worker's CPU 1.23 s per GB (gloo/floor" in line, line


@pytest.mark.parametrize("numbers, expected", [
    ([5, 6, 7], slice(5, 8)),
    ([3], slice(3, 4)),
    ([5, 7, 6], None),
    ([1, 3, 2, 4], None),  # the ends fit a run of four; the middle does not
    ([1, 2, 4, 3, 5, 9], None),
])
def test_a_batch_is_a_slice_only_when_it_numbers_consecutive_segments(
        numbers: list[int], expected: slice | None) -> None:
    assert floor_peer._run_of(np.array(numbers, np.uint32)) == expected


_PEER = ["--bind", "127.0.0.1", "--workers", "2", "--segments", "4", "--iters", "1"]


@pytest.mark.parametrize("program, argv, message", [
    (floor.parse_args, ["--size", "1MiB,2MiB"], "one size"),
    (floor.parse_args, ["--workers", "1"], "at least 2"),
    (floor.parse_args, ["--iters", "0"], "at least 1"),
    (floor.parse_args, ["--window", "0"], "at least 1"),
    (floor_peer.main, ["worker", *_PEER, "--payload", "8896"], "needs --appliance"),
    (floor_peer.main, ["appliance", *_PEER, "--payload", "8895"], "whole fp32 elements"),
    (floor_peer.main, ["appliance", *_PEER, "--payload", "65536"], "one UDP datagram"),
    (floor_peer.main, ["appliance", *_PEER, "--payload", "8896", "--silence-s", "0"],
     "more than 0 seconds"),
    (floor_peer.main, ["appliance", *_PEER, "--payload", "8896", "--window", "0"], "at least 1"),
])
def test_bad_arguments_are_refused_with_the_reason(
        program: Callable[[list[str]], object], argv: list[str], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert message in refusal(program, argv, capsys)


def _written(network: str = "rack", runs: int = 2) -> dict[str, object]:
    return {"plan": {"network": network, "workers": [8], "rate": "500mbit" if network == "rack"
                     else None, "sizes": [2**20]},
            "runs": [{"appliance_ratio": 1.0 + i / 10, "floor_ratio": 1.5, "kernel_ratio": 6.0}
                     for i in range(runs)]}


def test_a_plotted_case_is_named_by_its_plan_and_keeps_every_runs_ratios() -> None:
    case = floor_plot.case_of(_written(), target=2.0)
    assert case.label == "n = 8, 500mbit, 1 MiB" and case.target == 2.0
    assert case.ratios == {"appliance_ratio": [1.0, 1.1], "floor_ratio": [1.5, 1.5],
                           "kernel_ratio": [6.0, 6.0]}
    assert floor_plot.case_of(_written("loopback")).label == "n = 8, loopback, 1 MiB"
    written = _written()
    for run in written["runs"]:  # type: ignore[attr-defined]
        run["appliance_ratio"] = None  # --no-appliance: no such bar
    assert "appliance_ratio" not in floor_plot.case_of(written).ratios
    with pytest.raises(ValueError, match="no runs"):
        floor_plot.case_of(_written(runs=0))


def test_the_plot_is_written_from_json_files_with_their_targets(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the plot extra)")
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(_written()))
    second.write_text(json.dumps(_written("loopback")))
    image = tmp_path / "floor.png"
    assert floor_plot.main([str(image), f"{first}:2.0", str(second)]) == 0
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_refuses_what_bench_floor_did_not_write(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    assert floor_plot.main([str(tmp_path / "x.png"), str(other)]) == 1
    assert "not bench.floor's output" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        floor_plot.main([str(tmp_path / "x.png"), f"{other}:fast"])


def _floor_run() -> floor.FloorRun:
    return floor.FloorRun(segments=4, payload=8896, times=[0.1], ok=True,
                          cpu=MachineTime(0.1, 0.0, 0.1, 0.0), wall_s=0.1,
                          worker_receives=1, worker_sends=1, worker_cpu_s=0.1,
                          worker_kernel_cpu_s=0.05)


def test_a_floor_run_that_lost_a_datagram_runs_again_and_is_counted() -> None:
    outcomes: list[object] = [floor.FloorLost("lost one"), floor.FloorLost("lost two"),
                              _floor_run()]
    told: list[str] = []

    def run() -> floor.FloorRun:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        assert isinstance(outcome, floor.FloorRun)
        return outcome

    got, lost = floor.runs_until_one_is_whole(run, 3, lambda exc: told.append(str(exc)))
    assert (got.times, lost, told) == ([0.1], 2, ["lost one", "lost two"])


def test_the_floor_gives_up_after_its_attempts_and_at_once_on_any_other_failure() -> None:
    calls = 0

    def lossy() -> floor.FloorRun:
        nonlocal calls
        calls += 1
        raise floor.FloorLost(f"lost in run {calls}")

    with pytest.raises(floor.FloorLost, match=r"each of its 3 runs .*lost in run 3"):
        floor.runs_until_one_is_whole(lossy, 3)
    assert calls == 3

    def broken() -> floor.FloorRun:
        nonlocal calls
        calls += 1
        raise floor.HarnessError("a peer crashed")

    calls = 0
    with pytest.raises(floor.HarnessError, match="a peer crashed"):
        floor.runs_until_one_is_whole(broken, 3)
    assert calls == 1


def test_a_run_line_says_how_many_floor_runs_were_lost_before_it() -> None:
    row = {"floor_time_s": 0.6, "results_per_receive": 6.3, "segments_per_send": 6.4,
           "gloo": {"time_s": 0.3}, "floor_ratio": 0.5, "floor_kernel_s": 0.5,
           "floor_user_s": 0.7, "kernel_bound_s": 0.25, "kernel_ratio": 1.2, "appliance": None}
    assert "lost" not in floor.format_run(1, row | {"floor_runs_lost": 0})
    assert ("the floor lost a datagram in 2 runs before this one on the same network, and ran "
            "again") in floor.format_run(1, row | {"floor_runs_lost": 2})

