"""Allreduce: the appliance against Gloo ring, in the same run, on the same network.

    python -m bench.allreduce [--network loopback|rack] [--workers 4] [--rate 1gbit]
        [--sizes 64MiB] [--dtypes fp32] [--ops sum] [--iters 5] [--cores 2] [--unicast]
        [--json out.json]

One network (a private loopback namespace, or the emulated rack), two sweeps over the same cases:
first `reductiond` plus one bench.worker per rank, then (appliance stopped, so it takes no CPU)
one bench.gloo_worker per rank running torch.distributed's Gloo ring allreduce. Both build the
same integer-valued inputs and check every result against the same numpy reference.

Timing, identical for both: no barrier, untimed warmup, then back-to-back timed allreduce calls;
the time of an iteration is its slowest rank's, and a case's time is the median over iterations.
algbw = bytes / time. busbw (nccl-tests' 2(n-1)/n * algbw) is printed for Gloo only, and only for
orientation: it assumes a point-to-point algorithm, and a reduction server moves each byte once
per direction per worker, so busbw would overstate it by up to 2x (design.md section 5).

The default run is the issue's target, "loopback allreduce, n = 4, 64 MiB, not slower than Gloo",
and ends with a PASS/FAIL line for it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from deploy.testnet.topology import parse_rate

from .demo import human
from .harness import (
    HarnessError,
    LabNetwork,
    LoopbackNetwork,
    Network,
    run_workers,
    start_appliance,
)
from .worker import DTYPE_NAMES, parse_size

__all__ = ["main"]

_GLOO_PORT = 29500
_TARGET = {"network": "loopback", "workers": 4, "size": 64 << 20, "dtype": "float32",
           "op": "sum"}


@dataclass
class Plan:
    """What to run, resolved from the command line."""

    network: str
    workers: int
    rate: str | None
    sizes: list[int]
    dtypes: list[str]
    ops: list[str]
    iters: int
    warmup: int
    cores: int
    unicast: bool

    def case_args(self) -> list[str]:
        return ["--world", str(self.workers), "--sizes", ",".join(str(s) for s in self.sizes),
                "--dtypes", ",".join(self.dtypes), "--ops", ",".join(self.ops),
                "--iters", str(self.iters), "--warmup", str(self.warmup)]


# -- the network ----------------------------------------------------------------------------------

@contextlib.contextmanager
def network(plan: Plan) -> Iterator[Network]:
    if plan.network == "loopback":
        with LoopbackNetwork.create(multicast=not plan.unicast) as net:
            where = f"private namespace {net.netns}" if net.netns else "the host's loopback"
            print(f"network: loopback ({where}), {plan.workers} workers, MTU {net.mtu}, results by "
                  f"{'multicast' if net.multicast else 'unicast'} on the appliance side")
            yield net
        return
    if os.geteuid() != 0:
        raise HarnessError("--network rack needs root (network namespaces)")
    with LabNetwork.rack(plan.workers, multicast=not plan.unicast, rate=plan.rate) as lab:
        print(f"network: emulated rack, {plan.workers} workers at "
              f"{lab.worker_address(0)}.., appliance at {lab.appliance_address(0)}, one bridge, "
              f"MTU {lab.mtu}, worker links {plan.rate or 'unshaped'}, appliance link unshaped")
        # cast: harness.Network declares `mtu` as a plain attribute, LabNetwork has a property.
        yield cast(Network, lab)


def interface(net: Network, rank: int) -> str:
    return net.lab.interface_of(f"w{rank}") if isinstance(net, LabNetwork) else "lo"


def gloo_master(net: Network) -> str:
    """Rank 0's address and a port: fixed in a private namespace, a free one on a shared host."""
    if isinstance(net, LoopbackNetwork) and net.netns is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"127.0.0.1:{s.getsockname()[1]}"
    return f"{net.worker_address(0)}:{_GLOO_PORT}"


def _read(net: Network, who: str, index: int, argv: Sequence[str]) -> str:
    popen = net.popen_appliance if who == "appliance" else net.popen_worker
    proc = popen(index, list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=30)
    if proc.returncode != 0:
        raise HarnessError(f"{' '.join(argv)} in {who} {index}: {err.strip()}")
    return str(out)


def link_bytes(net: Network, who: str, index: int) -> tuple[int, int] | None:
    """(rx, tx) byte counters of a host's data interface, read inside its namespace; None on
    loopback, where one `lo` carries every direction of every process."""
    if not isinstance(net, LabNetwork):
        return None
    ifname = net.lab.interface_of(f"{'a' if who == 'appliance' else 'w'}{index}")
    out = _read(net, who, index, ["cat", f"/sys/class/net/{ifname}/statistics/rx_bytes",
                                  f"/sys/class/net/{ifname}/statistics/tx_bytes"])
    rx, tx = (int(x) for x in out.split())
    return rx, tx


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and all its live descendants (reductiond runs each data-plane
    core in a child process; the `ip netns exec` wrapper execs reductiond, so same pid)."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (ppid, cpu seconds)
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, frontier = 0.0, [pid]
    while frontier:
        current = frontier.pop()
        total += stats.get(current, (0, 0.0))[1]
        frontier.extend(child for child, (ppid, _) in stats.items() if ppid == current)
    return total


# -- the two sweeps -------------------------------------------------------------------------------

@dataclass
class Sweep:
    system: str
    rows: list[dict[str, Any]]
    wall_s: float
    worker_link: tuple[int, int] | None  # rank 0's (rx, tx) bytes over the sweep
    notes: dict[str, Any]


def _delta(after: tuple[int, int] | None,
           before: tuple[int, int] | None) -> tuple[int, int] | None:
    if after is None or before is None:
        return None
    return after[0] - before[0], after[1] - before[1]


def appliance_sweep(net: Network, plan: Plan) -> Sweep:
    with start_appliance(net, cores=plan.cores) as appliance:
        argv = [
            ["-m", "bench.worker", "--appliance", appliance.api, "--job", "allreduce",
             "--rank", str(rank), "--local", net.worker_address(rank), *plan.case_args()]
            + (["--unicast"] if plan.unicast else [])
            for rank in range(plan.workers)
        ]
        before = appliance.counters()
        cpu0, link0, alink0 = (cpu_seconds(appliance.process.pid), link_bytes(net, "worker", 0),
                               link_bytes(net, "appliance", 0))
        t0 = time.monotonic()
        outputs = run_workers(net, argv)
        wall = time.monotonic() - t0
        cpu = cpu_seconds(appliance.process.pid) - cpu0
        link = _delta(link_bytes(net, "worker", 0), link0)
        alink = _delta(link_bytes(net, "appliance", 0), alink0)
        after = appliance.counters()
    counters = {k: v - before.get(k, 0) for k, v in after.items()}
    return Sweep("appliance", summarize(outputs), wall, link,
                 {"counters": counters, "cpu_s": cpu, "appliance_link": alink})


def gloo_sweep(net: Network, plan: Plan) -> Sweep:
    master = gloo_master(net)
    argv = [["-m", "bench.gloo_worker", "--master", master, "--rank", str(rank),
             "--ifname", interface(net, rank), *plan.case_args()]
            for rank in range(plan.workers)]
    link0 = link_bytes(net, "worker", 0)
    t0 = time.monotonic()
    outputs = run_workers(net, argv)
    wall = time.monotonic() - t0
    return Sweep("gloo", summarize(outputs), wall, _delta(link_bytes(net, "worker", 0), link0),
                 {"master": master})


def summarize(outputs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per case: median over iterations of the slowest rank's time."""
    rows = []
    for cases in zip(*outputs, strict=True):
        first = cases[0]
        row: dict[str, Any] = {"size": first["size"], "dtype": first["dtype"], "op": first["op"],
                               "ok": all(c["ok"] for c in cases),
                               "checked": all(c["checked"] for c in cases)}
        skipped = [c["skipped"] for c in cases if c.get("skipped")]
        if skipped:
            row.update(skipped=skipped[0], time_s=None, algbw_gbps=None, times=[])
        else:
            per_iter = [max(c["times"][i] for c in cases) for i in range(len(first["times"]))]
            t = statistics.median(per_iter)
            row.update(time_s=t, algbw_gbps=first["size"] / t / 1e9, times=per_iter)
        if "retransmissions" in first:
            row["retransmissions"] = sum(c["retransmissions"] for c in cases)
        rows.append(row)
    return rows


# -- the report -----------------------------------------------------------------------------------

def _ms(t: float | None) -> str:
    return "skipped" if t is None else f"{t * 1e3:.2f}ms"


def _bw(b: float | None) -> str:
    return "-" if b is None else f"{b:.3f}GB/s"


def _flag(row: dict[str, Any]) -> str:
    if row.get("skipped"):
        return "skip"
    if not row["checked"]:
        return "unchk"
    return "exact" if row["ok"] else "WRONG"


def combine(plan: Plan, appl: Sweep, gloo: Sweep) -> list[dict[str, Any]]:
    combined = []
    n = plan.workers
    for a, g in zip(appl.rows, gloo.rows, strict=True):
        assert (a["size"], a["dtype"], a["op"]) == (g["size"], g["dtype"], g["op"])
        speedup = (g["time_s"] / a["time_s"]
                   if a["time_s"] is not None and g["time_s"] is not None else None)
        combined.append({
            "network": plan.network, "workers": n, "rate": plan.rate,
            "multicast": not plan.unicast, "size": a["size"], "dtype": a["dtype"], "op": a["op"],
            "appliance": a, "gloo": {
                **g, "busbw_gbps": None if g["algbw_gbps"] is None
                else 2 * (n - 1) / n * g["algbw_gbps"]},
            "speedup": speedup,
        })
    return combined


def report(plan: Plan, appl: Sweep, gloo: Sweep, rows: list[dict[str, Any]]) -> None:
    print(f"\n{plan.workers} workers, {plan.iters} timed iterations per case (+{plan.warmup} "
          f"warmup), no barrier; time = median over iterations of the slowest rank\n")
    head = (f"{'size':>9} {'dtype':>8} {'op':>4} | {'appliance':>9} {'algbw':>10} {'check':>5} | "
            f"{'gloo ring':>9} {'algbw':>10} {'busbw':>10} {'check':>5} | {'speedup':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        a, g = r["appliance"], r["gloo"]
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(f"{human(r['size']):>9} {r['dtype']:>8} {r['op']:>4} | {_ms(a['time_s']):>9} "
              f"{_bw(a['algbw_gbps']):>10} {_flag(a):>5} | {_ms(g['time_s']):>9} "
              f"{_bw(g['algbw_gbps']):>10} {_bw(g['busbw_gbps']):>10} {_flag(g):>5} | "
              f"{speed:>7}")
    print("speedup = gloo time / appliance time (>1: appliance faster). busbw = 2(n-1)/n * algbw "
          "assumes a point-to-point ring; it would overstate a reduction server by up to 2x, "
          "so the appliance gets algbw only.")
    for r in rows:
        if r["gloo"].get("skipped"):
            print(f"gloo skipped {human(r['size'])} {r['dtype']} {r['op']}: {r['gloo']['skipped']}")

    c = appl.notes["counters"]
    reduced, out = c.get("bytes_reduced", 0), c.get("bytes_out", 0)
    drops = ", ".join(f"{k}={v}" for k, v in c.items() if k.startswith("drop_") and v) or "none"
    retx = sum(r["appliance"].get("retransmissions", 0) for r in rows)
    print(f"\nappliance counters: {c.get('segments_reduced', 0)} segments reduced, "
          f"{human(reduced)} of results, {human(out)} sent = {out / max(1, reduced):.2f} bytes "
          f"out per result byte ({'multicast' if not plan.unicast else 'unicast'}; unicast "
          f"fan-out would be ~{plan.workers}; includes {c.get('results_resent', 0)} results resent "
          f"for {retx} worker retransmissions); drops: {drops}")
    cpu = appl.notes["cpu_s"]
    print(f"appliance CPU: {cpu:.2f} s over the {appl.wall_s:.1f} s appliance sweep "
          f"({cpu / max(1e-9, appl.wall_s):.2f} cores busy on average, {plan.cores} data-plane "
          f"cores configured; the sweep includes worker start-up and reference checks)")
    _report_links(plan, appl, gloo, rows)


def _report_links(plan: Plan, appl: Sweep, gloo: Sweep, rows: list[dict[str, Any]]) -> None:
    if appl.worker_link is None or gloo.worker_link is None:
        print("link bytes: not measured on loopback (one `lo` carries every direction)")
        return
    moved = sum(r["size"] for r in rows) * (plan.warmup + plan.iters)
    print(f"worker w0 link, bytes per allreduced byte over each sweep (rx / tx, incl. headers):"
          f" appliance {appl.worker_link[0] / moved:.2f} / {appl.worker_link[1] / moved:.2f}, "
          f"gloo {gloo.worker_link[0] / moved:.2f} / {gloo.worker_link[1] / moved:.2f} "
          f"(ideal: 1 / 1 and {2 * (plan.workers - 1) / plan.workers:.2f} / "
          f"{2 * (plan.workers - 1) / plan.workers:.2f})")
    alink = appl.notes.get("appliance_link")
    if alink is not None:
        print(f"appliance link, bytes per allreduced byte: rx {alink[0] / moved:.2f} "
              f"(ideal {plan.workers}), tx {alink[1] / moved:.2f} (ideal 1 with multicast)")
    if plan.rate:
        bps = parse_rate(plan.rate)
        for r in rows:
            for name, sweep in (("appliance", appl), ("gloo", gloo)):
                row = r[name]
                if row["time_s"] is None or sweep.worker_link is None:
                    continue
                per = [b / moved * row["size"] * 8 / row["time_s"] / bps
                       for b in sweep.worker_link]
                print(f"  {human(r['size'])} {r['dtype']} {name}: w0 link utilisation during the "
                      f"allreduce ~ rx {per[0]:.0%} / tx {per[1]:.0%} of {plan.rate}")


def verdict(plan: Plan, rows: list[dict[str, Any]]) -> bool | None:
    """The issue's target: on loopback, n = 4, 64 MiB fp32 sum, the appliance is not slower."""
    if plan.network != _TARGET["network"] or plan.workers != _TARGET["workers"]:
        return None
    for r in rows:
        if (r["size"], r["dtype"], r["op"]) == (_TARGET["size"], _TARGET["dtype"], _TARGET["op"]):
            ok = (r["speedup"] is not None and r["speedup"] >= 1.0 and r["appliance"]["ok"]
                  and r["gloo"]["ok"])
            a, g = r["appliance"]["time_s"], r["gloo"]["time_s"]
            print(f"\n{'PASS' if ok else 'FAIL'}: loopback allreduce n = 4, 64 MiB fp32: "
                  f"appliance {_ms(a)} vs gloo {_ms(g)} (target: not slower than Gloo)")
            return ok
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.allreduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--network", choices=["loopback", "rack"], default="loopback")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rate", default="1gbit", help="worker link rate in the rack (tc syntax)")
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                   default=[64 << 20])
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["fp32"])
    p.add_argument("--ops", type=lambda s: s.split(","), default=["sum"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cores", type=int, default=2, help="appliance data-plane cores")
    p.add_argument("--unicast", action="store_true", help="appliance results by unicast fan-out")
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    args = p.parse_args(argv)
    bad = [d for d in args.dtypes if d not in DTYPE_NAMES]
    if bad:
        p.error(f"unknown dtypes {bad}; choose from {sorted(DTYPE_NAMES)}")
    plan = Plan(network=args.network, workers=args.workers,
                rate=args.rate if args.network == "rack" else None, sizes=args.sizes,
                dtypes=args.dtypes, ops=args.ops, iters=args.iters, warmup=args.warmup,
                cores=args.cores, unicast=args.unicast)
    try:
        with network(plan) as net:
            appl = appliance_sweep(net, plan)
            gloo = gloo_sweep(net, plan)
    except HarnessError as exc:
        print(f"bench.allreduce failed: {exc}", file=sys.stderr)
        return 1
    rows = combine(plan, appl, gloo)
    report(plan, appl, gloo, rows)
    passed = verdict(plan, rows)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "plan": vars(plan), "rows": rows, "target_pass": passed,
            "appliance": {"wall_s": appl.wall_s, "worker_link": appl.worker_link, **appl.notes},
            "gloo": {"wall_s": gloo.wall_s, "worker_link": gloo.worker_link, **gloo.notes},
        }, indent=2))
    wrong = [r for r in rows for s in ("appliance", "gloo")
             if not r[s].get("skipped") and not r[s]["ok"]]
    if wrong:
        print(f"{len(wrong)} results differ from the numpy reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
