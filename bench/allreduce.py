"""Allreduce: the appliance against Gloo ring, in the same run, on the same network.

    python -m reduction_appliance.bench.allreduce [--network loopback|rack] [--workers 4]
        [--rate 1gbit] [--sizes 64MiB] [--dtypes fp32] [--ops sum] [--iters 5] [--cores 2]
        [--unicast] [--repeat 1] [--json out.json]

A one-worker-count run of the sweep engine (bench.sweep: same network for both systems, one
process set and one fresh job per case, the appliance stopped while Gloo runs, every result
checked against the numpy reference), reported side by side with the appliance's counters.

Timing, identical for both: no barrier, untimed warmup, then back-to-back timed allreduce calls;
the time of an iteration is its slowest rank's, and a case's time is the median over iterations.
algbw = bytes / time. busbw (nccl-tests' 2(n-1)/n * algbw) is printed for Gloo only, and only for
orientation: it assumes a point-to-point algorithm, and a reduction server moves each byte once
per direction per worker, so busbw would overstate it by up to 2x (bench/report.py's NOTE).
On the rack a case runs `--iters` timed calls or, for a small size, enough to move 16 MiB (at
most 64): the shaped links' token bucket lends a short run its bytes faster than the link, and
more to the appliance, which moves fewer of them (bench.plan's `SweepPlan.min_timed_bytes`).

The default run is the issue's target, "loopback allreduce, n = 4, 64 MiB, not slower than Gloo",
and ends with a PASS/FAIL line for it. `--repeat N` runs the whole comparison N times back to
back (a fresh network each time) and ends with each case's speedup as the median and spread of
the N runs, with every run's figure listed: one lucky run proves nothing on a shared machine.
Each run is framed by `bench.gauge`, how fast the machine ran plain Python just before and just
after it: where the appliance is CPU-bound and Gloo is not, the ratio follows that speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from reduction_appliance.dataplane.units import format_size
from reduction_appliance.deploy.testnet.harness import HarnessError

from .gauge import framing, interpreter_ms
from .plan import (
    OPS,
    SHAPED_TIMED_BYTES,
    SweepPlan,
    choice_list,
    dtype_list,
    size_list,
    tc_rate,
    unwritable_output,
)
from .progress import ProgressBar
from .sweep import Row, failed, multicast_possible, run_sweep

__all__ = ["main"]

_TARGET = {"network": "loopback", "workers": 4, "size": 64 << 20, "dtype": "float32",
           "op": "sum"}


class _Quiet:
    """Listener: the network line, then only the progress bar until the report at the end."""

    def __init__(self, total: int) -> None:
        self.progress = ProgressBar(total)

    def network_ready(self, workers: int, description: str) -> None:
        print(f"network: {description}, {workers} workers", flush=True)

    def case_started(self, label: str) -> None:
        self.progress.update(label=label)

    def row(self, row: Row) -> None:
        self.progress.advance()

    def workers_done(self, workers: int, rows: list[Row]) -> None:
        self.progress.close()


def pair(rows: list[Row]) -> list[dict[str, Any]]:
    """One record per case: the appliance row and the Gloo row side by side."""
    gloo = {(r["size"], r["dtype"], r["op"]): r for r in rows if r["system"] == "gloo"}
    return [{"network": a["network"], "workers": a["workers"], "rate": a["rate"],
             "multicast": a["mode"] == "multicast", "size": a["size"], "dtype": a["dtype"],
             "op": a["op"], "appliance": a, "gloo": gloo.get((a["size"], a["dtype"], a["op"])),
             "speedup": a["speedup"]}
            for a in rows if a["system"] == "appliance"]


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.2f}ms"


def _bw(b: float | None) -> str:
    return "-" if b is None else f"{b:.3f}GB/s"


# A case's bound, read off the timed calls: the machine's CPUs this busy (every process and
# the kernel) or stolen by the hypervisor leave no room for more, and a link this full is at
# the shaper's rate less the headers and the gaps between calls.
_CPU_BOUND = 0.95
_LINK_BOUND = 0.90
# /proc/stat counts in 10 ms ticks per CPU: below this much CPU time in all, a share is only
# good to a few per cent (five 20 ms calls on two CPUs are 20 ticks).
_FINE_S = 1.0


def _bound(row: Row) -> str:
    """'CPU-bound', 'link-bound', both, or 'neither saturated', for a probed case."""
    taken = (row.get("machine_busy_share") or 0.0) + (row.get("machine_steal_share") or 0.0)
    cpu = taken >= _CPU_BOUND
    link = max(row.get("link_rx_util") or 0.0, row.get("link_tx_util") or 0.0) >= _LINK_BOUND
    return {(True, True): "CPU- and link-bound", (True, False): "CPU-bound",
            (False, True): "link-bound", (False, False): "neither saturated"}[cpu, link]


def _flag(row: Row | None) -> str:
    if row is None or row.get("skipped"):
        return "skip"
    if row.get("error"):
        return "ERROR"
    return ("exact" if row["checked"] else "unchk") if row["ok"] else "WRONG"


def report(plan: SweepPlan, pairs: list[dict[str, Any]]) -> None:
    workers = plan.workers[0]
    timed = (f"{plan.iters} timed iterations per case"
             if all(plan.iters_for(size) == plan.iters for size in plan.sizes) else
             "timed iterations per case " + ", ".join(
                 f"{format_size(size)} {plan.iters_for(size)}" for size in plan.sizes))
    print(f"\n{workers} workers, {timed} (+{plan.warmup} warmup), "
          f"no barrier; time = median over iterations of the slowest rank\n")
    head = (f"{'size':>9} {'dtype':>8} {'op':>4} | {'appliance':>9} {'algbw':>10} {'check':>5} | "
            f"{'gloo ring':>9} {'algbw':>10} {'busbw':>10} {'check':>5} | {'speedup':>7}")
    print(head)
    print("-" * len(head))
    for p in pairs:
        a, g = p["appliance"], p["gloo"] or {}
        speed = "-" if p["speedup"] is None else f"{p['speedup']:.2f}x"
        print(f"{format_size(p['size']):>9} {p['dtype']:>8} {p['op']:>4} | {_ms(a['time_s']):>9} "
              f"{_bw(a['algbw_gbps']):>10} {_flag(a):>5} | {_ms(g.get('time_s')):>9} "
              f"{_bw(g.get('algbw_gbps')):>10} {_bw(g.get('busbw_gbps')):>10} "
              f"{_flag(p['gloo']):>5} | {speed:>7}")
        for system, row in (("appliance", a), ("gloo", g)):
            if row.get("error") or row.get("skipped"):
                print(f"  {system}: {row.get('error') or row.get('skipped')}")
    print("speedup = gloo time / appliance time (>1: appliance faster). busbw = 2(n-1)/n * algbw "
          "assumes a point-to-point ring; it would overstate a reduction server by up to 2x, "
          "so the appliance gets algbw only.")
    _report_appliance(plan, pairs)


def _why_resent(repairs: dict[str, int], total: int) -> str:
    """What sent the retransmissions again (plugin.slotplan.Repairs), as shares of them."""
    signs = (("timer", "timers ran out"), ("overtaken", "overtaken"),
             ("told", "told ours never came"))
    parts = [f"{repairs.get(key, 0) / total:.0%} {what}" for key, what in signs]
    return f"{', '.join(parts)}; {repairs.get('queries', 0) / total:.0%} went as queries"


def _report_appliance(plan: SweepPlan, pairs: list[dict[str, Any]]) -> None:
    workers = plan.workers[0]
    c: dict[str, int] = {}
    for p in pairs:
        for key, value in p["appliance"].get("counters", {}).items():
            c[key] = c.get(key, 0) + value
    # (less the echoes of the workers' path probes at join: no result byte's cost)
    reduced, out = c.get("bytes_reduced", 0), c.get("bytes_out", 0) - c.get("path_echo_bytes", 0)
    drops = ", ".join(f"{k}={v}" for k, v in c.items() if k.startswith("drop_") and v) or "none"
    retx = sum(p["appliance"].get("retransmissions") or 0 for p in pairs)
    multicast = bool(pairs) and pairs[0]["multicast"]
    print(f"\nappliance counters: {c.get('segments_reduced', 0)} segments reduced, "
          f"{format_size(reduced)} of results, {format_size(out)} sent = "
          f"{out / max(1, reduced):.2f} bytes out per result byte "
          f"({'multicast' if multicast else 'unicast'}; unicast fan-out would be ~{workers}; "
          f"includes {c.get('results_resent', 0)} results resent for {retx} worker "
          f"retransmissions); drops: {drops}")
    ideal = 2 * (workers - 1) / workers
    for p in pairs:
        a, g = p["appliance"], p["gloo"] or {}
        cpu = a.get("appliance_cpu_cores")
        line = (f"{format_size(p['size'])} {p['dtype']}: appliance CPU "
                f"{'-' if cpu is None else f'{cpu:.2f}'} cores busy during the timed calls "
                f"({plan.cores} data-plane cores configured)")
        if a.get("link_rx_per_byte") is not None and g.get("link_rx_per_byte") is not None:
            line += (f"; w0 link bytes per allreduced byte (rx / tx, incl. headers): appliance "
                     f"{a['link_rx_per_byte']:.2f} / {a['link_tx_per_byte']:.2f}, gloo "
                     f"{g['link_rx_per_byte']:.2f} / {g['link_tx_per_byte']:.2f} (ideal 1 / 1 "
                     f"and {ideal:.2f} / {ideal:.2f})")
        if a.get("ingress_gbps_per_core") is not None:
            line += f"; ingress {a['ingress_gbps_per_core']:.2f} GB/s per busy appliance core"
        if a.get("worker_cpu_s_per_gb") is not None:
            line += f"; worker CPU {a['worker_cpu_s_per_gb']:.2f} s per GB allreduced"
        if a.get("retx_share") is not None:
            line += f"; retransmissions {a['retx_share']:.2%} of segments"
            repairs = a.get("repairs")
            if repairs and a.get("retransmissions"):
                line += f" ({_why_resent(repairs, a['retransmissions'])})"
        if a.get("window_cuts") is not None:
            line += (f"; congestion windows cut {a['window_cuts']} times, least "
                     f"{a['window_least']} of {plan.slots} segments per core")
        if (a.get("machine_kernel_share") is not None
                and g.get("machine_kernel_share") is not None):
            line += (f"; machine CPU per GB allreduced (all processes and the kernel, per rank's "
                     f"GB): appliance {a['machine_cpu_s_per_gb']:.2f} s "
                     f"({a['machine_kernel_share']:.0%} kernel), gloo "
                     f"{g['machine_cpu_s_per_gb']:.2f} s ({g['machine_kernel_share']:.0%} kernel)")
        if a.get("machine_busy_share") is not None and g.get("machine_busy_share") is not None:
            line += (f"; the machine's CPU time in the timed calls: appliance "
                     f"{a['machine_busy_share']:.0%} busy, {a['machine_steal_share']:.1%} "
                     f"stolen by the hypervisor ({_bound(a)}), Gloo "
                     f"{g['machine_busy_share']:.0%} busy, {g['machine_steal_share']:.1%} "
                     f"stolen ({_bound(g)})")
            counted = min(a.get("machine_counted_s", 0.0), g.get("machine_counted_s", 0.0))
            if counted < _FINE_S:
                line += (f" (coarse: the timed calls span {counted * 100:.0f} of the kernel's "
                         "10 ms CPU ticks or fewer)")
        if a.get("link_rx_util") is not None:
            line += (f"; w0 link utilisation: appliance rx {a['link_rx_util']:.0%} / tx "
                     f"{a['link_tx_util']:.0%}, gloo rx {g.get('link_rx_util') or 0:.0%} / tx "
                     f"{g.get('link_tx_util') or 0:.0%} of {plan.rate}")
        print(line)
    if plan.network == "loopback":
        print("link bytes: not measured on loopback (one `lo` carries every direction)")


def verdict(plan: SweepPlan, pairs: list[dict[str, Any]]) -> bool | None:
    """The issue's target: on loopback, n = 4, 64 MiB fp32 sum, the appliance is not slower."""
    if plan.network != _TARGET["network"] or plan.workers != (_TARGET["workers"],):
        return None
    for p in pairs:
        if (p["size"], p["dtype"], p["op"]) == (_TARGET["size"], _TARGET["dtype"], _TARGET["op"]):
            a, g = p["appliance"], p["gloo"] or {}
            ok = (p["speedup"] is not None and p["speedup"] >= 1.0 and a["ok"]
                  and bool(g.get("ok")))
            print(f"\n{'PASS' if ok else 'FAIL'}: loopback allreduce n = 4, 64 MiB fp32: "
                  f"appliance {_ms(a['time_s'])} vs gloo {_ms(g.get('time_s'))} (target: not "
                  f"slower than Gloo)")
            return ok
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="reduction_appliance.bench.allreduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--network", choices=["loopback", "rack"], default="loopback")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rate", default="1gbit", help="worker link rate in the rack (tc syntax)")
    p.add_argument("--appliance-rate", type=tc_rate, default=None, metavar="RATE",
                   help="the appliance's link in the rack (tc syntax; default: unshaped): "
                        "below workers x --rate, an incast")
    p.add_argument("--sizes", type=size_list, default=[64 << 20])
    p.add_argument("--dtypes", type=dtype_list, default=["fp32"],
                   metavar="fp32,fp16,bf16")
    p.add_argument("--ops", type=choice_list(OPS), default=["sum"], metavar="sum,avg,min,max")
    p.add_argument("--iters", type=int, default=5,
                   help="timed calls per case, at least (on the rack, small sizes get enough to "
                        "move 16 MiB)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cores", type=int, default=2, help="appliance data-plane cores")
    p.add_argument("--slots", type=int, default=32,
                   help="slots per appliance core per job (jobs.slots): each worker's window")
    p.add_argument("--queue-target", type=float, default=0.025, metavar="SECONDS",
                   help="jobs.queue_target_s: the congestion windows' round-trip target "
                        "(0: fixed windows of --slots)")
    p.add_argument("--unicast", action="store_true", help="appliance results by unicast fan-out")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the comparison N times; print the median and spread of the ratio")
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    args = p.parse_args(argv)
    if (unwritable := unwritable_output(args.json, directory=False)) is not None:
        p.error(unwritable)
    if args.repeat < 1 or args.iters < 1:
        p.error("--repeat and --iters must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.slots < 1 or args.cores < 1:
        p.error("--slots and --cores must be at least 1")
    if not 0 <= args.queue_target <= 10:
        p.error("--queue-target must be 0..10 seconds")
    plan = SweepPlan(network=args.network, workers=(args.workers,),
                     rate=args.rate if args.network == "rack" else None, sizes=tuple(args.sizes),
                     dtypes=tuple(args.dtypes), ops=tuple(args.ops),
                     modes=("multicast",), iters=args.iters, warmup=args.warmup, cores=args.cores,
                     slots=args.slots, queue_target_s=args.queue_target,
                     appliance_rate=args.appliance_rate if args.network == "rack" else None,
                     # shaped links: enough timed calls that their bucket does not set the time
                     min_timed_bytes=SHAPED_TIMED_BYTES if args.network == "rack" else 0)
    if args.unicast or not multicast_possible(plan):  # not root: the host's loopback, unicast
        plan = dataclasses.replace(plan, modes=("unicast",))
    runs: list[list[dict[str, Any]]] = []
    verdicts: list[bool | None] = []
    wrong: list[Row] = []
    gauges: list[tuple[float, float]] = []  # this machine's Python speed before, after a run
    for run in range(args.repeat):
        if args.repeat > 1:
            print(f"\n=== run {run + 1} of {args.repeat}", flush=True)
        listener = _Quiet(plan.total_cases(multicast_possible(plan)))
        before = interpreter_ms()
        try:
            rows = run_sweep(plan, listener)
        except HarnessError as exc:
            listener.progress.close()
            print(f"reduction_appliance.bench.allreduce failed: {exc}", file=sys.stderr)
            return 1
        gauges.append((before, interpreter_ms()))
        pairs = pair(rows)
        report(plan, pairs)
        print(framing(*gauges[-1]))
        verdicts.append(verdict(plan, pairs))
        runs.append(pairs)
        wrong += failed(rows)
    if args.repeat > 1:
        summarize_runs(runs, gauges)
    passed = None if verdicts[0] is None else all(verdicts)
    if args.json is not None:
        args.json.write_text(json.dumps({"plan": plan.as_dict(), "runs": runs,
                                         "rows": runs[-1], "target_pass": passed,
                                         "gauge_ms": gauges}, indent=2))
    if wrong:
        print(f"{len(wrong)} results wrong or failed", file=sys.stderr)
        return 1
    return 0


def summarize_runs(runs: list[list[dict[str, Any]]], gauges: list[tuple[float, float]]) -> None:
    """Each case's speedup over the runs: median, spread, and every run's figure; then the
    machine's Python speed around each run (`bench.gauge`)."""
    print(f"\n=== {len(runs)} runs: speedup (gloo time / appliance time) per case")
    for i, first in enumerate(runs[0]):
        speedups = [r[i]["speedup"] for r in runs if r[i]["speedup"] is not None]
        times = [r[i]["appliance"]["time_s"] for r in runs
                 if r[i]["appliance"].get("time_s") is not None]
        label = f"{format_size(first['size'])} {first['dtype']} {first['op']}"
        if not speedups:
            print(f"  {label}: no speedup measured")
            continue
        steal = [r[i]["appliance"].get("machine_steal_share") for r in runs]
        counted = min(r[i]["appliance"].get("machine_counted_s", 0.0) for r in runs)
        steal_text = ("" if any(x is None for x in steal) else
                      "; hypervisor steal in the appliance's timed calls "
                      + ", ".join(f"{x:.1%}" for x in steal)
                      + (" (coarse: few 10 ms ticks)" if counted < _FINE_S else ""))
        print(f"  {label}: median {statistics.median(speedups):.2f}x "
              f"(min {min(speedups):.2f}x, max {max(speedups):.2f}x; runs "
              f"{', '.join(f'{x:.2f}x' for x in speedups)}); appliance "
              f"{_ms(statistics.median(times))} median{steal_text}")
    print("  this machine's Python (bench.gauge, ms before-after each run, lower is faster): "
          + ", ".join(f"{before:.1f}-{after:.1f}" for before, after in gauges))


if __name__ == "__main__":
    sys.exit(main())
