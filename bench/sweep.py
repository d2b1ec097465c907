"""An nccl-tests-style allreduce sweep: the appliance (per fan-out mode) against Gloo ring, on
the same network, in the same run.

    reductionctl bench --network rack --workers 4,8 --rate 500mbit \\
        --sizes 1KiB:64MiB:x4 --modes multicast,unicast --out results/

For each worker count: build ONE network (the emulated rack, or a private loopback namespace);
for each mode start `reductiond` and run every case; stop it; then run every case with Gloo ring
(torch.distributed) on the same network. Every case is its own set of worker processes and its
own freshly named job, deleted afterwards: workers count rounds per process, so a job is never
reused, and the measurements of one case are not disturbed by another's set-up.

Timing, identical for both systems: no barrier, untimed warmup, then back-to-back timed calls; an
iteration's time is its slowest rank's, a case's time the median over iterations. Rank 0 also
sums, over exactly its timed calls, the bytes on its link and the appliance's CPU seconds (see
deploy.testnet.probe): link utilisation = bytes / (timed seconds * rate), appliance CPU = cores
busy.

Writes results.json, results.csv and algbw.png to --out; exits 1 if any result was wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import socket
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from reduction_appliance.dataplane.units import format_size
from reduction_appliance.deploy.testnet.harness import (
    WORKER,
    ApplianceProcess,
    HarnessError,
    LabNetwork,
    LoopbackNetwork,
    Network,
    run_workers,
    start_appliance,
)
from reduction_appliance.deploy.testnet.probe import descendants
from reduction_appliance.deploy.testnet.topology import Link

from .plan import SweepPlan, add_sweep_arguments, dtype_name, plan_from_args, unwritable_output

__all__ = ["LabNet", "Listener", "Row", "appliance_case", "gloo_case", "lossy_where", "main",
           "open_network", "run", "run_sweep"]

Row = dict[str, Any]
_GLOO_BASE_PORT = 29500
# Each Gloo case binds a fresh rendezvous port: the previous case's listening socket may still
# sit in TIME_WAIT on the same address.
_GLOO_PORTS = 2000
_CASE_TIMEOUT_S = 900.0


class Listener(Protocol):
    """Receives the sweep's progress as it happens (the console report, the progress bar)."""

    def network_ready(self, workers: int, description: str) -> None: ...
    def case_started(self, label: str) -> None: ...
    def row(self, row: Row) -> None: ...
    def workers_done(self, workers: int, rows: list[Row]) -> None: ...


@dataclass
class LabNet:
    """A network the benchmarks built, said in words for their reports."""

    net: Network
    description: str
    links: bool  # does each worker have a link of its own (rate, byte counters)?


@contextlib.contextmanager
def open_network(plan: SweepPlan, workers: int) -> Iterator[LabNet]:
    if plan.network == "loopback":
        with LoopbackNetwork.create(multicast=True) as lo:
            where = f"private namespace {lo.netns}" if lo.netns else "the host's loopback"
            yield LabNet(lo, f"loopback ({where}), MTU {lo.mtu}", links=False)
        return
    if os.geteuid() != 0:
        raise HarnessError("--network rack needs root (network namespaces); try "
                           "--network loopback")
    with LabNetwork.rack(workers, rate=plan.rate, loss_pct=plan.loss_pct,
                         impaired=plan.lossy_ranks,
                         appliance_link=Link(plan.appliance_rate) if plan.appliance_rate
                         else None) as lab:
        # cast: harness.Network declares `mtu` as a plain attribute, LabNetwork has a property.
        yield LabNet(cast(Network, lab),
                     f"emulated rack {lab.lab.topology.name_prefix}: workers at "
                     f"{lab.worker_address(0)}.., appliance at {lab.appliance_address(0)}, "
                     f"one bridge, MTU {lab.mtu}, worker links {plan.rate or 'unshaped'}"
                     f"{f' with {plan.loss_pct:g}% loss each way' if plan.loss_pct else ''}"
                     f"{lossy_where(plan.lossy_ranks) if plan.loss_pct else ''}, "
                     f"appliance link {plan.appliance_rate or 'unshaped'}", links=True)


def lossy_where(ranks: tuple[int, ...] | None) -> str:
    """Whose links lose: every worker's, or the named ranks' alone."""
    if ranks is None:
        return ""
    many = "s" if len(ranks) > 1 else ""
    return f" on the link{many} of rank{many} {', '.join(map(str, ranks))} alone"


def multicast_possible(plan: SweepPlan) -> bool:
    """Multicast needs a namespace of our own (rack, or loopback as root)."""
    return plan.network == "rack" or os.geteuid() == 0


def _case_options(plan: SweepPlan, size: int, dtype: str, op: str) -> list[str]:
    return ["--sizes", str(size), "--dtypes", dtype, "--ops", op,
            "--iters", str(plan.iters_for(size)),
            "--warmup", str(plan.warmup), *([] if plan.check else ["--no-check"])]


def _probe_options(net: LabNet, pids: tuple[int, ...]) -> list[str]:
    link = ["--probe-link", net.net.worker_interface(0)] if net.links else []
    return ["--probe-machine", *link, *(["--probe-pids", ",".join(map(str, pids))] if pids else [])]


def summarize(plan: SweepPlan, net: LabNet, workers: int, outputs: list[list[Row]]) -> Row:
    """One row from one case's per-rank reports (each process ran exactly one case)."""
    cases = [out[0] for out in outputs]
    first = cases[0]
    row: Row = {"size": first["size"], "dtype": first["dtype"], "op": first["op"],
                "ok": all(c["ok"] for c in cases), "checked": all(c["checked"] for c in cases)}
    if any(c.get("skipped") for c in cases):
        return row | {"skipped": next(c["skipped"] for c in cases if c.get("skipped"))}
    per_iter = [max(c["times"][i] for c in cases) for i in range(len(first["times"]))]
    t = statistics.median(per_iter)
    row.update(time_s=t, times=per_iter, algbw_gbps=first["size"] / t / 1e9,
               window_s=max(c["window"][1] for c in cases) - min(c["window"][0] for c in cases))
    if "retransmissions" in first:
        row["retransmissions"] = sum(c["retransmissions"] for c in cases)
    if "repairs" in first:  # ... by what sent them, every rank's
        row["repairs"] = {key: sum(c["repairs"][key] for c in cases) for key in first["repairs"]}
    probed = first["probed_s"]  # the interval the counters cover (deploy.testnet.probe)
    moved = first["size"] * len(first["times"])
    link, rate = first.get("link"), plan.rate_bps
    if link is not None:
        row.update(link_rx_per_byte=link["rx"] / moved, link_tx_per_byte=link["tx"] / moved)
        if rate:
            row.update(link_rx_util=link["rx"] * 8 / (probed * rate),
                       link_tx_util=link["tx"] * 8 / (probed * rate))
    if "appliance_cpu_s" in first:
        row["appliance_cpu_cores"] = first["appliance_cpu_s"] / probed
        if first["appliance_cpu_s"] > 0:  # every rank's contributions per CPU-second
            row["ingress_gbps_per_core"] = len(cases) * moved / first["appliance_cpu_s"] / 1e9
    if "machine_cpu_s" in first:  # every process and the kernel, per GB one rank allreduced
        machine = first["machine_cpu_s"]
        user, kernel = machine["user"], machine["kernel"]
        row["machine_cpu_s_per_gb"] = (user + kernel) / (moved / 1e9)
        row["machine_kernel_share"] = kernel / (user + kernel) if user + kernel else None
        # Of all the CPUs' time in the timed calls: busy (near 100%: CPU-bound, whatever the
        # links), and what the hypervisor gave other guests (the noise to read a figure with).
        every = user + kernel + machine["idle"] + machine["steal"]
        if every > 0:
            row["machine_busy_share"] = (user + kernel) / every
            row["machine_steal_share"] = machine["steal"] / every
            row["machine_counted_s"] = every  # in 10 ms ticks: coarse for short timed calls
    if "segments" in first and "retransmissions" in row:
        row["retx_share"] = row["retransmissions"] / max(1, sum(c["segments"] for c in cases))
    if "window_cuts" in first:  # the congestion windows: cuts on every rank, the least one
        row["window_cuts"] = sum(c["window_cuts"] for c in cases)
        row["window_least"] = min(c["window_least"] for c in cases)
    if "worker_cpu_s" in first:  # the median rank's CPU per GB it allreduced
        row["worker_cpu_s_per_gb"] = statistics.median(
            c["worker_cpu_s"] for c in cases) / (moved / 1e9)
    if "worker_kernel_cpu_s" in first:  # ... and the kernel's part of it, the median rank's
        row["worker_kernel_cpu_s_per_gb"] = statistics.median(
            c["worker_kernel_cpu_s"] for c in cases) / (moved / 1e9)
    return row


def _base(plan: SweepPlan, workers: int, system: str, mode: str, size: int, dtype: str,
          op: str) -> Row:
    return {"network": plan.network, "rate": plan.rate, "workers": workers, "system": system,
            "mode": mode, "size": size, "dtype": dtype_name(dtype), "op": op,
            "iters": plan.iters_for(size),
            "time_s": None, "algbw_gbps": None, "busbw_gbps": None, "ok": False,
            "checked": False, "speedup": None}


def _job_name(workers: int, mode: str, index: int) -> str:
    return f"sweep-{os.getpid()}-n{workers}-{mode}-{index}"


def appliance_case(plan: SweepPlan, net: LabNet, appliance: ApplianceProcess,
                   pids: tuple[int, ...], workers: int, mode: str, index: int,
                   case: tuple[int, str, str]) -> Row:
    """One case on a running appliance (the lab worker on every rank, a fresh job, deleted
    after); `pids`: the appliance's processes, whose CPU rank 0 samples."""
    size, dtype, op = case
    row = _base(plan, workers, "appliance", mode, size, dtype, op)
    job = _job_name(workers, mode, index)
    secret = secrets.token_urlsafe(16)
    argv = [[*WORKER, "--appliance", appliance.api, "--job", job, f"--secret={secret}",
             "--world", str(workers), "--rank", str(rank),
             "--local", net.net.worker_address(rank), *_case_options(plan, size, dtype, op),
             *(["--unicast"] if mode == "unicast" else []),
             *(_probe_options(net, pids) if rank == 0 else [])]
            for rank in range(workers)]
    job_ids: list[int] = []
    try:
        outputs = run_workers(net.net, argv, timeout_s=_CASE_TIMEOUT_S)
        job_ids = outputs[0][0].get("job_ids", [])
        row.update(summarize(plan, net, workers, outputs))
    except (HarnessError, IndexError, KeyError) as exc:
        row["error"] = str(exc)[-2000:]
    try:
        # Free the job's slots: a sweep registers hundreds of jobs on one appliance.
        for job_id in job_ids or appliance.job_ids(job):
            appliance.delete_job(job_id)
    except HarnessError as exc:
        row["error"] = f"{row.get('error', '')} deleting job {job}: {exc}".strip()
    return row


def _gloo_master(net: LabNet, index: int) -> str:
    if isinstance(net.net, LoopbackNetwork) and net.net.netns is None:
        with socket.socket() as s:  # the host's own loopback: any free port
            s.bind(("127.0.0.1", 0))
            return f"127.0.0.1:{s.getsockname()[1]}"
    return f"{net.net.worker_address(0)}:{_GLOO_BASE_PORT + index % _GLOO_PORTS}"


def gloo_case(plan: SweepPlan, net: LabNet, workers: int, index: int,
              case: tuple[int, str, str]) -> Row:
    """One case of Gloo ring (bench.gloo_worker on every rank); `index` picks its rendezvous
    port, fresh per case."""
    size, dtype, op = case
    row = _base(plan, workers, "gloo", "ring", size, dtype, op)
    master = _gloo_master(net, index)
    argv = [["-m", "reduction_appliance.bench.gloo_worker", "--master", master,
             "--world", str(workers), "--rank", str(rank),
             "--ifname", net.net.worker_interface(rank),
             *_case_options(plan, size, dtype, op), *(_probe_options(net, ()) if rank == 0 else [])]
            for rank in range(workers)]
    try:
        row.update(summarize(plan, net, workers, run_workers(net.net, argv,
                                                             timeout_s=_CASE_TIMEOUT_S)))
    except (HarnessError, IndexError, KeyError) as exc:
        row["error"] = str(exc)[-2000:]
    if row["algbw_gbps"] is not None:
        # nccl-tests' bus bandwidth: a ring moves 2(n-1)/n bytes per byte on every link.
        row["busbw_gbps"] = 2 * (workers - 1) / workers * row["algbw_gbps"]
    return row


def _speedups(rows: list[Row]) -> None:
    """gloo time / appliance time for the same (workers, size, dtype, op), on appliance rows."""
    gloo = {(r["workers"], r["size"], r["dtype"], r["op"]): r["time_s"]
            for r in rows if r["system"] == "gloo"}
    for r in rows:
        g = gloo.get((r["workers"], r["size"], r["dtype"], r["op"]))
        if r["system"] == "appliance" and g and r["time_s"]:
            r["speedup"] = g / r["time_s"]


def run_sweep(plan: SweepPlan, listener: Listener) -> list[Row]:
    rows: list[Row] = []
    mc = multicast_possible(plan)
    for workers in plan.workers:
        mine: list[Row] = []
        with open_network(plan, workers) as net:
            listener.network_ready(workers, net.description)
            for system in plan.systems(mc):
                mine += _run_pass(plan, net, workers, system, listener)
        _speedups(mine)
        listener.workers_done(workers, mine)
        rows += mine
    return rows


def _run_pass(plan: SweepPlan, net: LabNet, workers: int, system: str,
              listener: Listener) -> list[Row]:
    rows = []
    label = "gloo ring" if system == "ring" else f"appliance {system}"
    if system == "ring":  # the appliance is stopped by now: Gloo gets every CPU
        for index, case in enumerate(plan.cases()):
            listener.case_started(f"n={workers} {label} {_case_label(case)}")
            rows.append(gloo_case(plan, net, workers, index, case))
            listener.row(rows[-1])
        return rows
    with start_appliance(net.net, cores=plan.cores, slots=plan.slots,
                         queue_target_s=plan.queue_target_s,
                         multicast=system == "multicast") as appl:
        pids = descendants(appl.process.pid)
        counters = appl.counters()
        for index, case in enumerate(plan.cases()):
            listener.case_started(f"n={workers} {label} {_case_label(case)}")
            row = appliance_case(plan, net, appl, pids, workers, system, index, case)
            # The appliance is idle between cases, so one read serves as "after" of this case
            # and "before" of the next.
            after = appl.counters()
            delta = {k: v - counters.get(k, 0) for k, v in after.items()}
            row["counters"] = delta
            if delta.get("bytes_reduced"):
                # 1 with multicast, ~n with unicast fan-out (plus headers and resends); the
                # echoes of the workers' path probes at join are no reduced byte's cost.
                sent = delta.get("bytes_out", 0) - delta.get("path_echo_bytes", 0)
                row["appliance_out_per_byte"] = sent / delta["bytes_reduced"]
            counters = after
            rows.append(row)
            listener.row(row)
    return rows


def _case_label(case: tuple[int, str, str]) -> str:
    return f"{format_size(case[0])} {case[1]} {case[2]}"


def failed(rows: list[Row]) -> list[Row]:
    """Rows whose result was wrong or that did not run (skipped by Gloo is not a failure)."""
    return [r for r in rows if not r.get("skipped") and (not r["ok"] or r.get("error"))]


def run(plan: SweepPlan, out: Path | None, plot: bool = True) -> int:
    """Run the sweep with the console report and progress bar; write results; exit status."""
    from .report import ConsoleReport, write_results

    report = ConsoleReport(plan, total=plan.total_cases(multicast_possible(plan)))
    try:
        rows = run_sweep(plan, report)
    except HarnessError as exc:
        report.close()
        print(f"sweep failed: {exc}", file=sys.stderr)
        return 1
    report.close()
    if out is not None:
        for path in write_results(out, plan, rows, plot=plot):
            print(f"wrote {path}")
    bad = failed(rows)
    if bad:
        print(f"{len(bad)} cases wrong or failed", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`reductionctl bench` (and `python -m reduction_appliance.bench.sweep`)."""
    p = argparse.ArgumentParser(prog="reductionctl bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_arguments(p)
    p.add_argument("--out", type=Path, default=Path("results"),
                   help="directory for results.json, results.csv, algbw.png (default: results)")
    p.add_argument("--no-plot", action="store_true", help="skip algbw.png")
    args = p.parse_args(argv)
    if (unwritable := unwritable_output(args.out, directory=True)) is not None:
        p.error(unwritable)
    try:
        plan = plan_from_args(args)
    except ValueError as exc:
        print(f"bad usage: {exc}", file=sys.stderr)
        return 2
    return run(plan, args.out, plot=not args.no_plot)


if __name__ == "__main__":
    sys.exit(main())
