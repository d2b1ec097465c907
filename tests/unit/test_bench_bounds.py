"""What the sweep and bench.allreduce say of a case's bound: how busy the machine was in the
timed calls, what the hypervisor took, and whether that made the case CPU- or link-bound."""

from __future__ import annotations

from typing import Any

import pytest

from reduction_appliance.bench import allreduce, gauge, report, sweep
from reduction_appliance.bench.plan import SweepPlan

PLAN = SweepPlan(network="rack", workers=(2,), rate="1gbit", sizes=(1 << 20,),
                 dtypes=("fp32",), ops=("sum",), modes=("multicast",), iters=2, warmup=1, cores=1)
NO_NET: Any = None  # summarize reads the ranks' reports and the plan, not the network


def _case(machine: dict[str, float]) -> list[dict[str, Any]]:
    """One rank's report of one case, as deploy.testnet.worker prints it."""
    return [{"size": 1 << 20, "dtype": "float32", "op": "sum", "ok": True, "checked": True,
             "times": [0.1, 0.1], "window": [0.0, 0.2], "probed_s": 0.2,
             "link": {"rx": 20_000_000, "tx": 20_000_000}, "machine_cpu_s": machine}]


def test_busy_and_steal_are_shares_of_all_the_cpus_time() -> None:
    # 2 CPUs for 0.2 s: 0.4 s in all, of it 0.3 busy, 0.06 idle, 0.04 stolen.
    row = sweep.summarize(PLAN, NO_NET, 2, [_case(
        {"user": 0.2, "kernel": 0.1, "idle": 0.06, "steal": 0.04})] * 2)
    assert row["machine_busy_share"] == pytest.approx(0.75)
    assert row["machine_steal_share"] == pytest.approx(0.1)
    assert row["machine_kernel_share"] == pytest.approx(1 / 3)
    assert row["machine_counted_s"] == pytest.approx(0.4)
    line = report.format_row({**row, "system": "appliance", "mode": "multicast",
                              "busbw_gbps": None})
    assert " 75%   10% |" in line, line


def test_a_machine_with_no_time_counted_has_no_shares() -> None:
    row = sweep.summarize(PLAN, NO_NET, 2, [_case(
        {"user": 0.0, "kernel": 0.0, "idle": 0.0, "steal": 0.0})])
    assert "machine_busy_share" not in row and "machine_steal_share" not in row


@pytest.mark.parametrize(("busy", "steal", "link", "bound"), [
    (0.99, 0.0, 0.80, "CPU-bound"),
    (0.91, 0.05, 0.80, "CPU-bound"),  # what the hypervisor took was no room either
    (0.50, 0.0, 0.97, "link-bound"),
    (0.97, 0.0, 0.95, "CPU- and link-bound"),
    (0.90, 0.04, 0.89, "neither saturated"),
])
def test_the_bound_is_read_off_the_cpus_left_idle_and_the_fuller_link_direction(
        busy: float, steal: float, link: float, bound: str) -> None:
    row = {"machine_busy_share": busy, "machine_steal_share": steal,
           "link_rx_util": link / 2, "link_tx_util": link}
    assert allreduce._bound(row) == bound


def test_the_runs_summary_quotes_each_run_s_steal(capsys: pytest.CaptureFixture[str]) -> None:
    def run(speedup: float, steal: float) -> list[dict[str, Any]]:
        return [{"size": 1 << 20, "dtype": "float32", "op": "sum", "speedup": speedup,
                 "appliance": {"time_s": 0.1, "machine_steal_share": steal,
                               "machine_counted_s": 0.2}}]
    allreduce.summarize_runs([run(1.5, 0.02), run(1.4, 0.125), run(1.6, 0.0)],
                             [(31.96, 32.04), (55.0, 57.5), (40.0, 33.3)])
    out = capsys.readouterr().out
    assert "median 1.50x (min 1.40x, max 1.60x" in out
    assert "hypervisor steal in the appliance's timed calls 2.0%, 12.5%, 0.0% (coarse" in out, out
    assert "lower is faster): 32.0-32.0, 55.0-57.5, 40.0-33.3" in out, out


def test_the_gauge_times_the_loop_and_takes_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    timings = iter([0.061, 0.032, 0.060, 0.063, 0.062])
    monkeypatch.setattr(gauge, "_loop", lambda: next(timings))
    assert gauge.interpreter_ms(5) == pytest.approx(61.0)
    with pytest.raises(ValueError, match="at least 1"):
        gauge.interpreter_ms(0)


def test_the_gauge_s_real_loop_runs_and_prints_its_median(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert 0 < gauge.interpreter_ms(1) < 60_000
    assert gauge.main(["--repeat", "3"]) == 0
    out = capsys.readouterr().out
    median, timings = out.split(" ms for a million turns")[0], out.split("timings ")[1]
    assert float(median) == sorted(float(t) for t in timings.split(", "))[1], out
    with pytest.raises(SystemExit):
        gauge.main(["--repeat", "0"])
