"""bench.targets and bench.verdicts: the fast-link issue's targets judged from what the
benchmarks wrote, on JSON made here in the benchmarks' own shapes (no benchmark runs)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from reduction_appliance.bench import targets
from reduction_appliance.bench.targets import GROUPS, Step, judge, plan_steps, run_steps
from reduction_appliance.bench.verdicts import Rule, Unit, Verdict, markdown_table
from reduction_appliance.deploy.testnet.unwind import unwinding_on_termination
from tests.refusals import refusal
from tests.signals import as_from_a_terminal
from tests.waiting import wait_until

MIB = 1 << 20


def _row(system: str, size: int, **extra: Any) -> dict[str, Any]:
    return {"system": system, "size": size, "dtype": "float32", "op": "sum", "ok": True,
            "checked": True, **extra}


def _allreduce(speedups: dict[int, list[float]], retx: float = 0.001,
               **appliance: Any) -> dict[str, Any]:
    """bench.allreduce --json: `runs`, each a list of cases (the appliance and Gloo paired)."""
    runs = []
    for run in range(len(next(iter(speedups.values())))):
        runs.append([{"size": size, "dtype": "float32", "op": "sum", "speedup": s[run],
                      "appliance": _row("appliance", size, retx_share=retx, **appliance),
                      "gloo": _row("gloo", size)}
                     for size, s in speedups.items()])
    return {"runs": runs, "gauge_ms": [[21.0, 22.5]] * len(runs)}


def _loss(times: dict[float, list[float]], size: int = 64 * MIB) -> dict[str, Any]:
    return {"rows": [_row("appliance", size, loss_pct=pct, time_s=t)
                     for pct, ts in times.items() for t in ts]}


def _ddp(backend: float, hook: float, agree: bool = True) -> dict[str, Any]:
    return {"rows": [{"comm": "gloo", "speedup": None, "ranks_agree": True},
                     {"comm": "reduction", "speedup": backend, "ranks_agree": agree},
                     {"comm": "hook", "speedup": hook, "ranks_agree": True}],
            "gauge_ms": [20.0, 23.0]}


def _write_all(out: Path, steps: list[Step], overrides: dict[str, Any] | None = None) -> None:
    """Every step's JSON, all targets met, unless `overrides` names a step's."""
    good = {
        "loopback": _allreduce({64 * MIB: [1.6, 1.7, 1.55]}),
        "rack-1gbit": _allreduce({64 * MIB: [1.5, 1.5, 1.46]}, link_rx_util=0.97,
                                 link_tx_util=0.96),
        "rack-n8-500mbit": _allreduce({MIB: [2.1, 2.2, 2.0], 64 * MIB: [1.7, 1.7, 1.66]}),
        "rack-10gbit": _allreduce({4 * MIB: [1.1, 1.0, 1.2], 64 * MIB: [1.4, 1.3, 1.35]},
                                  ingress_gbps_per_core=2.6),
        "loss": {"rows": _loss({0.0: [1.0, 1.0, 1.0], 1.0: [1.2, 1.3, 1.25],
                                5.0: [2.0, 2.1, 2.2], 20.0: [5.0, 6.0, 7.0]})["rows"]
                 + _loss({0.0: [0.01] * 3, 5.0: [0.05, 0.06, 0.04]}, MIB)["rows"]},
    }
    for step in steps:
        data = (overrides or {}).get(step.name) or good.get(step.name) or _ddp(1.45, 1.5)
        path = out / step.name / "ddp_steps.json" if step.module == "ddp_steps" else \
            out / f"{step.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))


def _by_target(verdicts: list[Verdict]) -> dict[str, Verdict]:
    return {v.target: v for v in verdicts}


def test_the_steps_are_the_issues_commands_with_their_json_under_the_run(tmp_path: Path) -> None:
    steps = plan_steps(tmp_path, 3)
    assert [s.name for s in steps] == [
        "loopback", "rack-1gbit", "rack-n8-500mbit", "rack-10gbit", "loss",
        "ddp-1gbit-1", "ddp-1gbit-2", "ddp-1gbit-3", "ddp-500mbit-1", "ddp-500mbit-2",
        "ddp-500mbit-3"]
    ten = next(s for s in steps if s.name == "rack-10gbit")
    assert ten.shown() == (
        "python -m reduction_appliance.bench.allreduce --network rack --rate 10gbit --sizes "
        f"4MiB,64MiB --repeat 3 --json {tmp_path / 'rack-10gbit.json'}")
    assert [s.name for s in plan_steps(tmp_path, 1, ["loss", "ddp-1gbit"])] == [
        "loss", "ddp-1gbit-1"]


def test_every_target_met_when_every_figure_reaches_its_goal(tmp_path: Path) -> None:
    steps = plan_steps(tmp_path, 3)
    _write_all(tmp_path, steps)
    judged = judge(tmp_path, steps)
    verdicts, problems, gauges = judged.verdicts, judged.problems, judged.gauges
    assert problems == []
    assert len(verdicts) == 17
    assert [v.target for v in verdicts if not v.met] == []
    assert min(gauges) == 20.0 and max(gauges) == 23.0
    ten = _by_target(verdicts)["rack, n = 4, 10 Gbit/s, 64 MiB: appliance vs Gloo"]
    assert ten.values == (1.4, 1.3, 1.35)
    assert ten.figures() == "1.35x (1.30x-1.40x)"
    loss1 = _by_target(verdicts)["1% loss, 64 MiB: throughput vs lossless"]
    assert loss1.figures() == "80% (77%-83%)"


def test_the_loopback_target_must_hold_in_each_run_not_only_at_the_median(
        tmp_path: Path) -> None:
    steps = plan_steps(tmp_path, 3)
    _write_all(tmp_path, steps, {"loopback": _allreduce({64 * MIB: [1.6, 1.7, 1.45]})})
    by = _by_target(judge(tmp_path, steps).verdicts)
    loopback = by["loopback, n = 4, 64 MiB: appliance vs Gloo"]
    assert loopback.rule is Rule.EACH
    assert loopback.met is False
    assert loopback.worst == 1.45


def test_one_case_over_the_retransmission_goal_fails_that_target(tmp_path: Path) -> None:
    steps = plan_steps(tmp_path, 3)
    _write_all(tmp_path, steps, {"rack-1gbit": _allreduce({64 * MIB: [1.5] * 3}, retx=0.006,
                                                          link_rx_util=1.0, link_tx_util=1.0)})
    retx = next(v for v in judge(tmp_path, steps).verdicts if v.unit is Unit.SHARE
                and v.rule is Rule.EVERY_BELOW)
    assert retx.met is False
    assert retx.worst == 0.006


def test_the_link_counts_by_its_less_busy_direction(tmp_path: Path) -> None:
    steps = plan_steps(tmp_path, 1, ["rack-1gbit"])
    _write_all(tmp_path, steps, {"rack-1gbit": _allreduce({64 * MIB: [1.5]}, link_rx_util=0.99,
                                                          link_tx_util=0.93)})
    link = next(v for v in judge(tmp_path, steps).verdicts if "link busy" in v.target)
    assert link.values == (0.93,)
    assert link.met is False


def test_a_failed_step_leaves_its_targets_unmeasured_and_says_why(tmp_path: Path) -> None:
    steps = plan_steps(tmp_path, 2)
    _write_all(tmp_path, steps)
    (tmp_path / "rack-10gbit.json").unlink()
    outcomes = [targets.Outcome("rack-10gbit", 1, 3.0)]
    judged = judge(tmp_path, steps, outcomes)
    verdicts, problems = judged.verdicts, judged.problems
    ten = [v for v in verdicts if v.step == "rack-10gbit"]
    assert len(ten) == 3 and all(v.met is None for v in ten)
    assert ten[0].figures() == "not measured: rack-10gbit exited with status 1"
    assert problems == ["rack-10gbit: no figures: rack-10gbit exited with status 1"]


def test_a_wrong_result_or_ranks_that_disagree_are_problems(tmp_path: Path) -> None:
    steps = plan_steps(tmp_path, 1, ["loopback", "loss", "ddp-1gbit"])
    wrong = _allreduce({64 * MIB: [1.6]})
    wrong["runs"][0][0]["appliance"]["ok"] = False
    lossy = _loss({0.0: [1.0], 5.0: [2.0]})
    lossy["rows"][1].update(ok=False, error="timed out")
    _write_all(tmp_path, steps, {"loopback": wrong, "loss": lossy,
                                 "ddp-1gbit-1": _ddp(1.3, 1.3, agree=False)})
    problems = judge(tmp_path, steps).problems
    assert problems == [
        "loopback: appliance 64 MiB: differs from the numpy reference",
        "loss: appliance 64 MiB at 5% loss: timed out",
        "ddp-1gbit run 1: reduction: ranks ended with different parameters"]


def test_the_ddp_runs_of_a_group_make_one_target_each_for_the_backend_and_the_hook(
        tmp_path: Path) -> None:
    steps = plan_steps(tmp_path, 3, ["ddp-500mbit"])
    _write_all(tmp_path, steps, {"ddp-500mbit-1": _ddp(1.41, 1.42),
                                 "ddp-500mbit-2": _ddp(1.38, 1.44),
                                 "ddp-500mbit-3": _ddp(1.43, 1.39)})
    by = _by_target(judge(tmp_path, steps).verdicts)
    backend = by["DDP step, 4 ranks, 500 Mbit/s: backend vs Gloo"]
    assert backend.values == (1.41, 1.38, 1.43) and backend.met is True
    assert by["DDP step, 4 ranks, 500 Mbit/s: comm hook vs Gloo"].figures() == \
        "1.42x (1.39x-1.44x)"


def test_the_cost_table_gives_each_case_its_medians(tmp_path: Path) -> None:
    steps = plan_steps(tmp_path, 3, ["rack-10gbit"])
    ten = _allreduce({4 * MIB: [0.7, 0.6, 0.8], 64 * MIB: [0.5, 0.6, 0.55]})
    for run, cpu in zip(ten["runs"], (10.0, 12.0, 11.0), strict=True):
        for p in run:
            p["appliance"].update(machine_cpu_s_per_gb=cpu, machine_kernel_share=0.25,
                                  worker_cpu_s_per_gb=1.6, worker_kernel_cpu_s_per_gb=0.4,
                                  ingress_gbps_per_core=1.1, appliance_cpu_cores=0.7)
            p["gloo"].update(machine_cpu_s_per_gb=6.0, machine_kernel_share=0.7)
    _write_all(tmp_path, steps, {"rack-10gbit": ten})
    rows = judge(tmp_path, steps).costs.splitlines()
    assert len(rows) == 4
    assert rows[2] == ("| rack-10gbit 4 MiB float32 | 11.00 s (25% kernel) | 6.00 s (70% kernel) "
                       "| 1.60 s (25% kernel) | 1.10 GB/s | 0.70 |")


def test_run_steps_goes_on_after_a_failure(tmp_path: Path) -> None:
    steps = plan_steps(tmp_path, 1, ["loopback", "loss"])
    ran: list[str] = []

    def runner(step: Step) -> int:
        ran.append(step.name)
        return 3 if step.name == "loopback" else 0

    outcomes = run_steps(tmp_path, steps, runner)
    assert ran == ["loopback", "loss"]
    assert [(o.step, o.returncode) for o in outcomes] == [("loopback", 3), ("loss", 0)]


def test_a_step_that_fails_now_is_not_judged_by_an_earlier_runs_json(tmp_path: Path) -> None:
    steps = plan_steps(tmp_path, 1, ["loopback", "ddp-1gbit"])
    _write_all(tmp_path, steps)  # an earlier run into the same directory

    def runner(step: Step) -> int:
        return 1  # writes nothing

    outcomes = run_steps(tmp_path, steps, runner)
    verdicts = judge(tmp_path, steps, outcomes).verdicts
    assert [v.met for v in verdicts if v.step in ("loopback", "ddp-1gbit")] == [None] * 3


def test_a_figure_that_would_read_as_its_goal_gets_one_more_digit() -> None:
    v = Verdict("n = 8", "s", Unit.RATIO, 1.65, Rule.MEDIAN, (1.6472, 1.6056, 1.6710))
    assert v.met is False
    assert v.figures() == "1.647x (1.61x-1.67x)"
    assert v.goal_text() == ">= 1.65x"
    share = Verdict("loss", "s", Unit.SHARE, 0.70, Rule.MEDIAN, (0.698,))
    assert share.figures() == "69.8% (69.8%-69.8%)"


def test_the_table_is_markdown_with_one_row_per_target() -> None:
    v = Verdict("t", "s", Unit.RATIO, 1.3, Rule.MEDIAN, (1.0, 1.2, 1.1))
    table = markdown_table([v, Verdict("u", "s", Unit.GBPS, 2.5, Rule.MEDIAN, (), "no JSON")])
    assert table.splitlines()[2] == "| t | 1.10x (1.00x-1.20x) | 1.00x | >= 1.30x | not met | s |"
    assert table.splitlines()[3] == \
        "| u | not measured: no JSON | - | >= 2.50 GB/s | not measured | s |"


def test_report_judges_a_saved_run_again_and_draws_it(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the plot extra)")
    steps = plan_steps(tmp_path, 1, ["rack-10gbit", "loss"])
    (tmp_path / "targets.json").write_text(json.dumps(
        {"steps": [{"name": s.name, "group": s.group, "module": s.module, "argv": list(s.argv)}
                   for s in steps]}))
    _write_all(tmp_path, steps, {"rack-10gbit": _allreduce({4 * MIB: [0.7], 64 * MIB: [0.57]},
                                                           ingress_gbps_per_core=1.1)})
    assert targets.main(["--report", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| rack, n = 4, 10 Gbit/s, 64 MiB: appliance vs Gloo | 0.57x (0.57x-0.57x) | 0.57x " \
           "| >= 1.30x | not met | rack-10gbit |" in printed
    assert (tmp_path / "targets.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "targets.json").read_text())
    assert saved["verdicts"][0]["met"] is False
    assert targets.main(["--report", str(tmp_path)]) == 0  # what it wrote judges again


def test_report_keeps_how_the_steps_ended(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    steps = plan_steps(tmp_path, 1, ["loopback", "loss"])
    _write_all(tmp_path, steps)
    (tmp_path / "targets.json").write_text(json.dumps(
        {"steps": [{"name": s.name, "group": s.group, "module": s.module, "argv": list(s.argv)}
                   for s in steps],
         "outcomes": [{"step": "loopback", "returncode": 0, "seconds": 40.0},
                      {"step": "loss", "returncode": 1, "seconds": 200.0}]}))
    assert targets.main(["--report", str(tmp_path)]) == 1  # a step failed, then as now
    assert json.loads((tmp_path / "targets.json").read_text())["outcomes"][1] == {
        "step": "loss", "returncode": 1, "seconds": 200.0}
    capsys.readouterr()


@pytest.mark.parametrize(("argv", "reason"), [
    (["--repeat", "0"], "--repeat must be at least 1"),
    (["--only", "loopback,warp"], "unknown steps ['warp']"),
    (["--report", "/nonexistent/run"], "no such directory"),
])
def test_bad_arguments_are_refused_with_the_reason(argv: list[str], reason: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert reason in refusal(targets.main, argv, capsys)


def test_report_of_a_directory_without_a_run_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "no targets.json of an earlier run" in refusal(
        targets.main, ["--report", str(tmp_path)], capsys)


def test_every_group_is_planned() -> None:
    assert {s.group for s in plan_steps(Path("x"), 1)} == set(GROUPS)


# A step that takes its time to tear down when stopped (the sleep is that teardown's work).
TEARS_DOWN = """
import os, pathlib, signal, sys, time
done = pathlib.Path(sys.argv[1])
def stop(signum, frame):
    time.sleep(0.5)  # the workload: a teardown longer than subprocess.run's 0.25 s grace
    done.write_text(signal.Signals(signum).name)
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
(done.parent / "ready").write_text(str(os.getpid()))
while True:
    signal.pause()
"""


@dataclass(frozen=True)
class ScriptStep(Step):
    script: str = ""

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script, *self.argv]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_run_gives_its_step_the_signal_and_time_to_tear_down(
        signum: int, tmp_path: Path) -> None:
    """subprocess.run killed the step 0.25 s after Ctrl-C, with its rack still up; a SIGTERM
    left it running alone. (A SIGINT that reached only this process is passed on.)"""
    done, ready = tmp_path / "done", tmp_path / "ready"
    step = ScriptStep("s", "g", "m", (str(done),), script=TEARS_DOWN)

    def stop_when_ready() -> None:
        step_pid = int(wait_until(lambda: ready.exists() and ready.read_text(), 30,
                                  what="the step to start"))
        os.kill(os.getpid(), signum)
        try:
            wait_until(done.exists, 60, what="the step's teardown")
        except TimeoutError:
            # Never a hang: a signal this process dropped leaves the step paused (not yet
            # reaped: its pid is its own) and `_run_process` waiting; killed, the step ends
            # that wait and the test fails.
            os.kill(step_pid, signal.SIGKILL)

    threading.Thread(target=stop_when_ready, daemon=True).start()
    with as_from_a_terminal(), pytest.raises(KeyboardInterrupt), unwinding_on_termination():
        targets._run_process(step)
    assert done.read_text() == signal.Signals(signum).name
