"""Several ranks per host (servers with several GPUs and one NIC): torch's all_reduce through
the appliance, reduced on each host first and flat, against Gloo's ring, side by side on one
emulated rack.

    python -m reduction_appliance.bench.hosts --hosts 2 --ranks-per-host 4 --rate 1gbit \\
        --size 64MiB --repeat 3 [--out DIR]

Builds ONE rack of --hosts hosts, their links shaped to --rate, --ranks-per-host ranks in each
host's namespace, and one appliance. Each repeat runs bench.hosts_worker on every rank three
times: Gloo's ring ("gloo": neighbours on a host talk over loopback), the "reduction" backend
as it comes ("staged": it reduces on each host first, `plugin.torch_hosts`) and with
REDUCTION_HIERARCHY=flat ("flat": every rank sends its whole tensor through its host's NIC).

A call's time is its slowest rank's; a run's figure is the median over --iters calls after
--warmup. Speedup = Gloo's median / the run's median, per repeat; the summary gives the
median of the repeats and their range. Every result is checked exactly; exits 1 if one was
wrong or a run failed. With --out, writes hosts.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from reduction_appliance.dataplane.units import format_size, parse_size
from reduction_appliance.deploy.testnet.harness import (
    HarnessError,
    LabNetwork,
    Network,
    run_workers,
    start_appliance,
)
from reduction_appliance.deploy.testnet.topology import parse_rate

from .gauge import framing, interpreter_ms
from .plan import unwritable_output
from .progress import ProgressBar

__all__ = ["MODES", "Plan", "main", "summarize"]

MODES = ("gloo", "staged", "flat")
_STORE_BASE_PORT = 29700  # a fresh rendezvous port per run (the last may be in TIME_WAIT)
_RUN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Plan:
    hosts: int
    ranks_per_host: int
    rate: str | None  # host link rate, tc syntax; None = unshaped veth
    size: int
    iters: int
    warmup: int
    repeat: int
    cores: int

    @property
    def world(self) -> int:
        return self.hosts * self.ranks_per_host


def worker_argv(net: Network, plan: Plan, mode: str, api: str, port: int) -> list[list[str]]:
    store = f"{net.worker_address(0)}:{port}"
    return [["-m", "reduction_appliance.bench.hosts_worker",
             "--backend", "gloo" if mode == "gloo" else "reduction",
             "--hierarchy", "flat" if mode == "flat" else "auto",
             "--store", store, "--world", str(plan.world), "--rank", str(rank),
             "--local", net.worker_address(rank), "--ifname", net.worker_interface(rank),
             "--appliance", api, "--size", str(plan.size), "--iters", str(plan.iters),
             "--warmup", str(plan.warmup)]
            for rank in range(plan.world)]


def one_run(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's figure from its ranks' reports: the median over calls of the slowest rank."""
    per_call = [max(times) for times in zip(*(r["times"] for r in ranks), strict=True)]
    return {"median_s": statistics.median(per_call), "calls_s": per_call,
            "ok": all(r["ok"] for r in ranks), "staged": sorted({r["staged"] for r in ranks})}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: the repeats' medians; per appliance mode: the speedup over Gloo in each
    repeat (side by side), its median and range."""
    out: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        row: dict[str, Any] = {"median_s": [r["median_s"] for r in mine]}
        if mode != "gloo":
            gloo = {r["repeat"]: r["median_s"] for r in runs if r["mode"] == "gloo"}
            speedups = [gloo[r["repeat"]] / r["median_s"] for r in mine if r["repeat"] in gloo]
            if speedups:
                row.update(speedups=speedups, speedup_median=statistics.median(speedups),
                           speedup_range=(min(speedups), max(speedups)))
        out[mode] = row
    return out


def format_report(plan: Plan, runs: list[dict[str, Any]]) -> str:
    summary = summarize(runs)
    lines = [f"all_reduce of {format_size(plan.size)} fp32 on {plan.hosts} hosts x "
             f"{plan.ranks_per_host} ranks, host links {plan.rate or 'unshaped'}, median of "
             f"{plan.iters} calls (slowest rank) per run, {plan.repeat} repeat(s)", "",
             f"{'mode':<7} {'per repeat (ms)':<28} {'speedup vs gloo':<34} {'exact':>5}"]
    for mode, row in summary.items():
        times = ", ".join(f"{t * 1e3:.0f}" for t in row["median_s"])
        if "speedups" in row:
            low, high = row["speedup_range"]
            speed = (f"{row['speedup_median']:.2f}x ({low:.2f}-{high:.2f}): "
                     + ", ".join(f"{s:.2f}" for s in row["speedups"]))
        else:
            speed = "-"
        exact = all(r["ok"] for r in runs if r["mode"] == mode)
        lines.append(f"{mode:<7} {times:<28} {speed:<34} {'yes' if exact else 'NO':>5}")
    lines += ["", "staged: the backend reduces on each host over loopback first, and one rank "
              "per host talks to the appliance;",
              "flat: every rank sends its whole tensor through its host's link "
              "(REDUCTION_HIERARCHY=flat)."]
    return "\n".join(lines)


def run_plan(plan: Plan, progress: ProgressBar | None = None) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    with LabNetwork.rack(plan.world, rate=plan.rate, ranks_per_host=plan.ranks_per_host) as net, \
            start_appliance(net, cores=plan.cores) as appliance:
        for repeat in range(plan.repeat):
            for mode in MODES:
                if progress is not None:
                    progress.update(label=f"repeat {repeat + 1} {mode}")
                port = _STORE_BASE_PORT + len(runs)
                outputs = run_workers(net, worker_argv(net, plan, mode, appliance.api, port),
                                      timeout_s=_RUN_TIMEOUT_S)
                ranks = [out[-1] for out in outputs if out]
                if len(ranks) != plan.world:
                    raise HarnessError(f"{mode}: {plan.world - len(ranks)} ranks printed no "
                                       "report")
                runs.append({"mode": mode, "repeat": repeat, **one_run(ranks)})
                if progress is not None:
                    progress.advance()
    return runs


def parse_args(argv: list[str] | None) -> tuple[Plan, Path | None]:
    p = argparse.ArgumentParser(prog="reduction_appliance.bench.hosts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=4)
    p.add_argument("--rate", default="1gbit",
                   help="host link rate, tc syntax (default 1gbit); 'none' for unshaped")
    p.add_argument("--size", default="64MiB", help="the tensor, e.g. 16MiB (fp32)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cores", type=int, default=2, help="appliance data-plane cores")
    p.add_argument("--out", type=Path, default=None, help="directory for hosts.json")
    args = p.parse_args(argv)
    if (unwritable := unwritable_output(args.out, directory=True)) is not None:
        p.error(unwritable)
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        p.error(f"--size {args.size!r}: {exc}")
    rate = None if args.rate.lower() == "none" else args.rate
    if rate is not None:
        try:
            parse_rate(rate)
        except ValueError as exc:
            p.error(str(exc))
    if args.hosts < 2 or args.ranks_per_host < 2:
        p.error("--hosts >= 2 and --ranks-per-host >= 2, please: with fewer, nothing is "
                "reduced on a host")
    if size < 4 or size % 4 or args.iters < 1 or args.warmup < 0 or args.repeat < 1 \
            or args.cores < 1:
        p.error("--size a whole number of fp32 elements, --iters >= 1, --warmup >= 0, "
                "--repeat >= 1 and --cores >= 1, please")
    return Plan(hosts=args.hosts, ranks_per_host=args.ranks_per_host, rate=rate, size=size,
                iters=args.iters, warmup=args.warmup, repeat=args.repeat,
                cores=args.cores), args.out


def main(argv: list[str] | None = None) -> int:
    plan, out = parse_args(argv)
    if os.geteuid() != 0:
        print("bench.hosts needs root: the rack is built from network namespaces",
              file=sys.stderr)
        return 1
    progress = ProgressBar(plan.repeat * len(MODES))
    before = interpreter_ms()
    try:
        runs = run_plan(plan, progress)
    except HarnessError as exc:
        progress.close()
        print(f"bench.hosts failed: {exc}", file=sys.stderr)
        return 1
    progress.close()
    gauge = (before, interpreter_ms())
    print(format_report(plan, runs))
    print(framing(*gauge))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "hosts.json"
        path.write_text(json.dumps({"plan": asdict(plan), "runs": runs,
                                    "summary": summarize(runs), "gauge_ms": gauge},
                                   indent=2) + "\n")
        print(f"wrote {path}")
    wrong = [r for r in runs if not r["ok"]]
    staged_as_named = all(r["staged"] == [r["mode"] == "staged"] for r in runs)
    if not staged_as_named:
        print("a run did not stage as its mode says (see 'staged' in the runs)", file=sys.stderr)
    return 0 if not wrong and staged_as_named else 1


if __name__ == "__main__":
    sys.exit(main())
