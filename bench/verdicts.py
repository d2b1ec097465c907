"""The fast-link issue's targets judged from what the benchmarks wrote: one `Verdict` per target,
with every run's figure, so that a reader sees the median, the spread and the worst run side by
side with the goal (bench.targets runs the benchmarks; this module only reads their JSON).

Each figure is the one the benchmark itself measured side by side in one run: a ratio against
Gloo ring on the same network in the same run (`bench.allreduce`, `bench.ddp_steps`), a share of
the lossless time in the same repeat's baseline (`bench.loss`), or a per-byte cost of the
appliance (`bench.allreduce`'s probes). A target is met by the median of the runs unless its rule
says otherwise: the loopback ratio must hold in each run, and retransmissions in every case.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from reduction_appliance.dataplane.units import format_size

from .loss import TARGETS as LOSS_TARGETS

__all__ = ["Rule", "Unit", "Verdict", "all_verdicts", "cost_table", "exactness",
           "markdown_table"]

MIB = 1 << 20
Written = Mapping[str, Any]  # a step's JSON, as the benchmark wrote it


class Rule(Enum):
    """How the runs' figures meet a goal."""

    MEDIAN = "median"  # the median of the runs reaches it
    EACH = "each run"  # every run reaches it
    EVERY_BELOW = "every case below"  # every figure stays under it (a cost)


class Unit(Enum):
    RATIO = "x"
    SHARE = "%"
    GBPS = "GB/s"


@dataclass(frozen=True)
class Verdict:
    """One target: its figures (one per run or case), the goal and how it is judged."""

    target: str
    step: str  # the bench.targets step that measures it
    unit: Unit
    goal: float
    rule: Rule
    values: tuple[float, ...]
    missing: str = ""  # why there are no figures (the step failed or was not run)

    @property
    def met(self) -> bool | None:
        """None: not measured."""
        if not self.values:
            return None
        if self.rule is Rule.EVERY_BELOW:
            return max(self.values) < self.goal
        if self.rule is Rule.EACH:
            return min(self.values) >= self.goal
        return statistics.median(self.values) >= self.goal

    @property
    def worst(self) -> float | None:
        if not self.values:
            return None
        return max(self.values) if self.rule is Rule.EVERY_BELOW else min(self.values)

    def show(self, value: float) -> str:
        """`value` in the goal's unit; with one more digit where it would read as the goal
        without being it (1.647x against 1.65x is not met)."""
        text = self._digits(value, 0)
        if value != self.goal and text == self._digits(self.goal, 0):
            return self._digits(value, 1)
        return text

    def _digits(self, value: float, more: int) -> str:
        if self.unit is Unit.RATIO:
            return f"{value:.{2 + more}f}x"
        if self.unit is Unit.GBPS:
            return f"{value:.{2 + more}f} GB/s"
        return f"{value:.{2 + more}%}" if value < 0.1 else f"{value:.{more}%}"

    def figures(self) -> str:
        """`median (min-max)`, or why there are none."""
        if not self.values:
            return f"not measured: {self.missing or 'no figures'}"
        lo, hi = min(self.values), max(self.values)
        return f"{self.show(statistics.median(self.values))} ({self.show(lo)}-{self.show(hi)})"

    def goal_text(self) -> str:
        sign = "<" if self.rule is Rule.EVERY_BELOW else ">="
        rule = "" if self.rule is Rule.MEDIAN else f", {self.rule.value}"
        return f"{sign} {self.show(self.goal)}{rule}"

    def verdict_text(self) -> str:
        return {None: "not measured", True: "met", False: "not met"}[self.met]


# --- reading each benchmark's JSON ------------------------------------------------------------

def _pairs(written: Written, size: int) -> list[dict[str, Any]]:
    """bench.allreduce: the fp32 sum case of `size`, one record per run."""
    return [p for run in written.get("runs", []) for p in run
            if p["size"] == size and p["dtype"] == "float32" and p["op"] == "sum"]


def _speedups(written: Written, size: int) -> tuple[float, ...]:
    return tuple(p["speedup"] for p in _pairs(written, size) if p.get("speedup") is not None)


def _appliance(written: Written, size: int,
               of: Callable[[dict[str, Any]], float | None]) -> tuple[float, ...]:
    """`of` each run's appliance row of the case."""
    values = [of(p["appliance"]) for p in _pairs(written, size)]
    return tuple(v for v in values if v is not None)


def _ingress(a: dict[str, Any]) -> float | None:
    return a.get("ingress_gbps_per_core")


def _link_busy(a: dict[str, Any]) -> float | None:
    """The worker link's busier-than-the-other direction would flatter it: the lesser of the two."""
    rx, tx = a.get("link_rx_util"), a.get("link_tx_util")
    return None if rx is None or tx is None else min(rx, tx)


def _retransmissions(steps: Mapping[str, Written]) -> tuple[float, ...]:
    """Every lossless case of every bench.allreduce step, every run."""
    return tuple(p["appliance"]["retx_share"] for written in steps.values()
                 if "runs" in written for run in written["runs"] for p in run
                 if p["appliance"].get("retx_share") is not None)


def _loss_shares(written: Written, loss: float, size: int) -> tuple[float, ...]:
    """bench.loss: each repeat's time at `loss` against the median lossless time of `size`."""
    rows = [r for r in written.get("rows", []) if r["size"] == size and r.get("time_s")]
    base = [r["time_s"] for r in rows if r["loss_pct"] == 0.0]
    if not base:
        return ()
    lossless = statistics.median(base)
    return tuple(lossless / r["time_s"] for r in rows if r["loss_pct"] == loss)


def _ddp(runs: Sequence[Written], comm: str) -> tuple[float, ...]:
    """bench.ddp_steps, one JSON per run: `comm`'s step-time ratio against Gloo's."""
    return tuple(row["speedup"] for written in runs for row in written.get("rows", [])
                 if row["comm"] == comm and row.get("speedup") is not None)


# --- the targets --------------------------------------------------------------------------------

def all_verdicts(steps: Mapping[str, Written], ddp: Mapping[str, Sequence[Written]],
                 missing: Mapping[str, str]) -> list[Verdict]:
    """The issue's targets in its order. `steps`: each allreduce/loss step's JSON by step name;
    `ddp`: each DDP step group's runs; `missing`: why a step has no JSON."""
    def get(name: str) -> Written:
        return steps.get(name, {})

    def why(name: str) -> str:
        return missing.get(name, "")

    ten, one, n8 = get("rack-10gbit"), get("rack-1gbit"), get("rack-n8-500mbit")
    out = [
        Verdict("rack, n = 4, 10 Gbit/s, 64 MiB: appliance vs Gloo", "rack-10gbit", Unit.RATIO,
                1.3, Rule.MEDIAN, _speedups(ten, 64 * MIB), why("rack-10gbit")),
        Verdict("rack, n = 4, 10 Gbit/s, 4 MiB: appliance vs Gloo", "rack-10gbit", Unit.RATIO,
                1.0, Rule.MEDIAN, _speedups(ten, 4 * MIB), why("rack-10gbit")),
        Verdict("loopback, n = 4, 64 MiB: appliance vs Gloo", "loopback", Unit.RATIO, 1.5,
                Rule.EACH, _speedups(get("loopback"), 64 * MIB), why("loopback")),
        Verdict("appliance ingress per busy core, rack 10 Gbit/s, 64 MiB", "rack-10gbit",
                Unit.GBPS, 2.5, Rule.MEDIAN,
                _appliance(ten, 64 * MIB, _ingress), why("rack-10gbit")),
        Verdict("lossless retransmissions, every rack and loopback case above",
                "allreduce steps", Unit.SHARE, 0.005, Rule.EVERY_BELOW,
                _retransmissions(steps)),
    ]
    loss = get("loss")
    for (pct, size), share in LOSS_TARGETS.items():
        out.append(Verdict(f"{pct:g}% loss, {format_size(size)}: throughput vs lossless",
                           "loss", Unit.SHARE, share, Rule.MEDIAN,
                           _loss_shares(loss, pct, size), why("loss")))
    out += [
        Verdict("rack, n = 4, 1 Gbit/s, 64 MiB: worker link busy",
                "rack-1gbit", Unit.SHARE, 0.95, Rule.MEDIAN,
                _appliance(one, 64 * MIB, _link_busy), why("rack-1gbit")),
        Verdict("rack, n = 4, 1 Gbit/s, 64 MiB: appliance vs Gloo", "rack-1gbit", Unit.RATIO,
                1.45, Rule.MEDIAN, _speedups(one, 64 * MIB), why("rack-1gbit")),
        Verdict("rack, n = 8, 500 Mbit/s, 64 MiB: appliance vs Gloo", "rack-n8-500mbit",
                Unit.RATIO, 1.65, Rule.MEDIAN, _speedups(n8, 64 * MIB), why("rack-n8-500mbit")),
        Verdict("rack, n = 8, 500 Mbit/s, 1 MiB: appliance vs Gloo", "rack-n8-500mbit",
                Unit.RATIO, 2.0, Rule.MEDIAN, _speedups(n8, MIB), why("rack-n8-500mbit")),
    ]
    for group, goal in (("ddp-1gbit", 1.2), ("ddp-500mbit", 1.4)):
        rate = group.removeprefix("ddp-").replace("gbit", " Gbit/s").replace("mbit", " Mbit/s")
        for comm, what in (("reduction", "backend"), ("hook", "comm hook")):
            out.append(Verdict(f"DDP step, 4 ranks, {rate}: {what} vs Gloo", group, Unit.RATIO,
                               goal, Rule.MEDIAN, _ddp(ddp.get(group, ()), comm), why(group)))
    return out


def _result_rows(written: Written) -> list[dict[str, Any]]:
    """Every checked call's row: bench.allreduce's appliance and Gloo rows of every run, or
    bench.loss's rows."""
    if "runs" not in written:
        return list(written.get("rows", []))
    return [row for run in written["runs"] for p in run
            for row in (p["appliance"], p["gloo"]) if row]


def exactness(steps: Mapping[str, Written], ddp: Mapping[str, Sequence[Written]]) -> list[str]:
    """Every result that was not exact (or not checked), in words; empty when all were."""
    bad: list[str] = []
    for name, written in steps.items():
        for r in _result_rows(written):
            if r.get("skipped"):
                continue
            if not r.get("ok") or not r.get("checked", True):
                loss = f" at {r['loss_pct']:g}% loss" if "loss_pct" in r else ""
                bad.append(f"{name}: {r.get('system', 'appliance')} {format_size(r['size'])}"
                           f"{loss}: {r.get('error') or 'differs from the numpy reference'}")
    for group, runs in ddp.items():
        for i, written in enumerate(runs, 1):
            for row in written.get("rows", []):
                if not row.get("ranks_agree"):
                    bad.append(f"{group} run {i}: {row['comm']}: ranks ended with different "
                               "parameters")
    return bad


def markdown_table(verdicts: Sequence[Verdict]) -> str:
    lines = ["| target | median (range) | worst run | goal | verdict | step |",
             "|---|---|---|---|---|---|"]
    for v in verdicts:
        worst = "-" if v.worst is None else v.show(v.worst)
        lines.append(f"| {v.target} | {v.figures()} | {worst} | {v.goal_text()} | "
                     f"{v.verdict_text()} | {v.step} |")
    return "\n".join(lines)


def _median_of(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _cost(value: float | None, kernel: float | None = None, unit: str = " s") -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{unit}" + ("" if kernel is None else f" ({kernel:.0%} kernel)")


def cost_table(steps: Mapping[str, Written]) -> str:
    """Where the CPU goes per byte, each bench.allreduce case (medians over its runs): the whole
    machine's CPU per GB allreduced for the appliance and for Gloo (every process and the
    kernel), a worker's own, and the appliance's ingress per busy core."""
    lines = ["| case | machine CPU per GB: appliance | Gloo | a worker's CPU per GB | "
             "appliance ingress per busy core | appliance cores busy |",
             "|---|---|---|---|---|---|"]
    for name, written in steps.items():
        if "runs" not in written or not written["runs"]:
            continue
        for i, first in enumerate(written["runs"][0]):
            pairs = [run[i] for run in written["runs"] if i < len(run)]
            a = [p["appliance"] for p in pairs]
            g = [p["gloo"] for p in pairs if p.get("gloo")]
            worker = _median_of(a, "worker_cpu_s_per_gb")
            worker_kernel = _median_of(a, "worker_kernel_cpu_s_per_gb")
            cells = [
                _cost(_median_of(a, "machine_cpu_s_per_gb"), _median_of(a, "machine_kernel_share")),
                _cost(_median_of(g, "machine_cpu_s_per_gb"), _median_of(g, "machine_kernel_share")),
                _cost(worker, worker_kernel / worker if worker and worker_kernel is not None
                      else None),
                _cost(_median_of(a, "ingress_gbps_per_core"), unit=" GB/s"),
                _cost(_median_of(a, "appliance_cpu_cores"), unit=""),
            ]
            lines.append(f"| {name} {format_size(first['size'])} {first['dtype']} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)
