"""The sweep's report: a table on stdout as rows arrive, and results.json / results.csv / algbw.png.

A rate-limited rack bounds both systems (R = worker link rate in bytes/s): a reduction server
moves each byte once per direction per worker link, so algbw <= R; a ring moves 2(n-1)/n bytes
per byte, so algbw <= R / (2(n-1)/n).
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, TextIO

from reduction_appliance.dataplane.units import format_size
from reduction_appliance.deploy.testnet.shaping import tbf_params

from .plan import SweepPlan, dtype_name
from .progress import ProgressBar

__all__ = [
    "CSV_FIELDS",
    "NOTE",
    "ConsoleReport",
    "bounds_gbps",
    "burst_bytes",
    "environment",
    "write_results",
]

Row = dict[str, Any]
_RACK_MTU = 9000  # Topology.rack's default, what the sweep builds

NOTE = (
    "busbw (nccl-tests' bus bandwidth, algbw * 2(n-1)/n) converts a ring's algbw into what "
    "each link carried, assuming a point-to-point algorithm in which every worker sends and "
    "receives 2(n-1)/n bytes per allreduced byte. A reduction server has every worker send each "
    "byte once and receive the result once, so the same factor would overstate it by up to 2x; "
    "busbw is therefore shown for Gloo only, and algbw (bytes / time) is the honest figure to "
    "compare. The link columns show what worker w0's link actually carried during the timed "
    "calls, per direction, as a share of the link rate. busy and steal: the share of all the "
    "machine's CPU time in the timed calls that some process or the kernel used, and that the "
    "hypervisor gave other guests; a case whose busy and steal add up to near 100% was "
    "CPU-bound, whatever its links."
)

CSV_FIELDS = [
    "network", "rate", "workers", "system", "mode", "size", "dtype", "op", "iters", "time_s",
    "algbw_gbps", "busbw_gbps", "speedup", "link_rx_util", "link_tx_util", "link_rx_per_byte",
    "link_tx_per_byte", "appliance_cpu_cores", "appliance_out_per_byte", "retransmissions",
    "retx_share", "ingress_gbps_per_core", "worker_cpu_s_per_gb", "machine_cpu_s_per_gb",
    "machine_kernel_share", "machine_busy_share", "machine_steal_share", "machine_counted_s",
    "window_s", "checked", "ok", "skipped", "error",
]


def burst_bytes(rate_bps: int) -> int:
    """The rack's tbf bucket: a message up to about this size leaves at veth speed, so small
    cases may beat the bounds; the bounds hold for sizes well above it."""
    return tbf_params(rate_bps, _RACK_MTU)["burst"]


def bounds_gbps(rate_bps: int, workers: int,
                appliance_bps: int | None = None) -> dict[str, float]:
    """algbw bounds of a rack whose worker links run at `rate_bps` (and the appliance's at
    `appliance_bps`: every worker's bytes cross it, so it bounds at 1/workers of it), in GB/s."""
    r = rate_bps / 8 / 1e9
    server = r if appliance_bps is None else min(r, appliance_bps / 8 / 1e9 / workers)
    return {"reduction server": server, "gloo ring": r / (2 * (workers - 1) / workers)}


def environment() -> dict[str, object]:
    versions: dict[str, str | None] = {}
    for package in ("numpy", "torch"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "kernel": platform.release(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), **versions,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# -- the console ----------------------------------------------------------------------------------

def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.2f}ms"


def _bw(b: float | None) -> str:
    return "-" if b is None else f"{b:.3f}GB/s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _check(row: Row) -> str:
    if row.get("skipped"):
        return "skip"
    if row.get("error"):
        return "ERROR"
    if not row["checked"]:
        return "unchk" if row["ok"] else "WRONG"
    return "exact" if row["ok"] else "WRONG"


_HEAD = (f"{'system':<9} {'mode':<9} {'size':>9} {'dtype':>8} {'op':>3} | {'time':>9} "
         f"{'algbw':>10} {'busbw':>10} | {'w0 rx':>5} {'w0 tx':>5} | {'appl CPU':>10} "
         f"{'in/core':>10} {'wkr s/GB':>8} {'mach s/GB':>14} {'busy':>4} {'steal':>5} | "
         f"{'retx':>11} | check")


def format_row(row: Row) -> str:
    cpu, ingress = row.get("appliance_cpu_cores"), row.get("ingress_gbps_per_core")
    worker, share = row.get("worker_cpu_s_per_gb"), row.get("retx_share")
    retx = row.get("retransmissions")
    machine, kernel = row.get("machine_cpu_s_per_gb"), row.get("machine_kernel_share")
    machine_text = "-" if machine is None else (
        f"{machine:.2f}" if kernel is None else f"{machine:.2f} {kernel:.0%}kern")
    retx_text = "-" if retx is None else (
        f"{retx}" if share is None else f"{retx} {share:.1%}")
    return (f"{row['system']:<9} {row['mode']:<9} {format_size(row['size']):>9} {row['dtype']:>8} "
            f"{row['op']:>3} | {_ms(row['time_s']):>9} {_bw(row['algbw_gbps']):>10} "
            f"{_bw(row['busbw_gbps']):>10} | {_pct(row.get('link_rx_util')):>5} "
            f"{_pct(row.get('link_tx_util')):>5} | "
            f"{'-' if cpu is None else f'{cpu:.2f} cores':>10} "
            f"{'-' if ingress is None else f'{ingress:.2f}GB/s':>10} "
            f"{'-' if worker is None else f'{worker:.2f}':>8} {machine_text:>14} "
            f"{_pct(row.get('machine_busy_share')):>4} {_pct(row.get('machine_steal_share')):>5} | "
            f"{retx_text:>11} | {_check(row)}")


def side_by_side(plan: SweepPlan, workers: int, rows: list[Row]) -> list[str]:
    """One line per case: every appliance mode next to Gloo ring, with the speedup."""
    present = {(r["system"], r["mode"]) for r in rows}
    columns = [c for c in [*(("appliance", m) for m in plan.modes), ("gloo", "ring")]
               if c in present]
    lines = [f"\nn = {workers}: time, algbw; speedup = gloo ring time / appliance time"]
    if plan.rate_bps:
        b = bounds_gbps(plan.rate_bps, workers, plan.appliance_rate_bps)
        at = f" and {plan.appliance_rate} at the appliance" if plan.appliance_rate else ""
        lines.append(f"bounds at {plan.rate} per worker link{at}: reduction server "
                     f"{b['reduction server']:.4f} GB/s, gloo ring {b['gloo ring']:.4f} GB/s "
                     f"(tbf lets {format_size(burst_bytes(plan.rate_bps))} bursts through at veth "
                     f"speed: sizes up to about that may beat them)")
    cell = 28
    lines.append(f"{'size':>9} {'dtype':>8} {'op':>3} | "
                 + " | ".join(f"{(s if s == 'gloo' else 'appl') + ' ' + m:<{cell}}"
                              for s, m in columns))
    by_key = {(r["system"], r["mode"], r["size"], r["dtype"], r["op"]): r for r in rows}
    for size, dtype, op in plan.cases():
        cells = []
        for system, mode in columns:
            r = by_key.get((system, mode, size, dtype_name(dtype), op))
            if r is None:
                cells.append(f"{'':<{cell}}")
                continue
            speed = f"{r['speedup']:.2f}x" if r.get("speedup") else ""
            text = f"{_ms(r['time_s'])} {_bw(r['algbw_gbps'])} {speed}"
            cells.append(f"{text if _check(r) in ('exact', 'unchk') else _check(r):<{cell}}")
        lines.append(f"{format_size(size):>9} {dtype_name(dtype):>8} {op:>3} | "
                     + " | ".join(cells))
    return lines


class ConsoleReport:
    """The sweep's Listener: streams rows under a header per worker count, a side-by-side
    comparison when a worker count is done, and the progress bar on stderr throughout."""

    def __init__(self, plan: SweepPlan, total: int, out: TextIO | None = None) -> None:
        self.plan = plan
        self.out = out if out is not None else sys.stdout
        self.progress = ProgressBar(total)
        self._noted = False

    def _print(self, text: str) -> None:
        self.progress.clear()
        print(text, file=self.out, flush=True)

    def network_ready(self, workers: int, description: str) -> None:
        p = self.plan
        self._print(f"\n== {workers} workers on {description}\n{p.iters} timed iterations per "
                    f"case (+{p.warmup} warmup), no barrier; time = median over iterations of "
                    f"the slowest rank; w0 rx/tx = worker 0's link utilisation during its timed "
                    f"calls; appl CPU = appliance cores busy meanwhile; in/core = what the "
                    f"appliance ingested per CPU-second; wkr s/GB = a worker's CPU seconds per "
                    f"GB allreduced; mach s/GB = every process's and the kernel's; busy, "
                    f"steal = the machine's CPU time in the timed calls that was used, and "
                    f"that the hypervisor took (the two near 100%: CPU-bound); retx = worker "
                    f"retransmissions and their share of segments\n")
        self._print(_HEAD)
        self._print("-" * len(_HEAD))

    def case_started(self, label: str) -> None:
        self.progress.update(label=label)

    def row(self, row: Row) -> None:
        self._print(format_row(row))
        if row.get("error"):
            self._print(f"    error: {row['error'][-500:]}")
        if row.get("skipped"):
            self._print(f"    skipped: {row['skipped']}")
        self.progress.advance()

    def workers_done(self, workers: int, rows: list[Row]) -> None:
        for line in side_by_side(self.plan, workers, rows):
            self._print(line)
        if not self._noted:
            self._noted = True
            self._print("\nNote: " + NOTE)

    def close(self) -> None:
        self.progress.close()


# -- files ----------------------------------------------------------------------------------------

def _csv_value(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def write_results(out: Path, plan: SweepPlan, rows: list[Row], plot: bool = True) -> list[Path]:
    """results.json (plan, environment, rows), results.csv (one line per row), algbw.png."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.csv"]
    written[0].write_text(json.dumps({"plan": plan.as_dict(), "environment": environment(),
                                      "note": NOTE, "rows": rows}, indent=2) + "\n")
    with written[1].open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in CSV_FIELDS})
    if plot:
        try:
            from .plot import plot_algbw
        except ImportError as exc:
            print(f"no algbw.png: {exc} (install the plot extra: pip install "
                  f"'reduction-appliance[plot]')", file=sys.stderr)
        else:
            written.append(plot_algbw(out / "algbw.png", plan, rows))
    return written
