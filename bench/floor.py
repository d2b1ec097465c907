"""How fast any appliance could be here: its traffic with the least Python, against Gloo ring.

    python -m reduction_appliance.bench.floor [--network rack|loopback] [--workers 4]
        [--rate 10gbit] [--size 64MiB] [--iters 5] [--window 64] [--no-appliance]
        [--repeat 3] [--json out.json]

On the emulated rack every host shares this machine's few CPUs, so where links are fast the
appliance's speed is the CPU its traffic costs. This asks how much of that cost is ours. On ONE
network (the one bench.allreduce builds) it runs, on fp32 sums, Gloo ring and then the appliance
(bench.sweep's cases, every result checked), then the floor (bench/floor_peer.py): the same
datagrams through the same sockets as the appliance's data path (GSO sends, GRO receives,
multicast results, a window of segments per worker), the sum of each segment formed on the
appliance, but none of the protocol, and a few numpy calls per coalesced receive as the only
Python per datagram.

It prints, per run:

* each system's time: the median over its timed iterations of the slowest worker's; the
  appliance's also as a share of the floor's speed (floor time / appliance time).
* Gloo's time / the floor's: the most an appliance on these sockets, spending at least the
  floor's Python, could reach against Gloo on this machine and network now.
* the kernel's CPU in the floor's iterations (the machine's system, irq and softirq time from
  /proc/stat, per iteration) spread over every CPU: the time the kernel's work alone fills,
  and Gloo's time / that. No user-space code reaches past this ratio while the kernel's UDP
  path carries these bytes: only a kernel that spent less on them could (another network path,
  fewer copies, other hardware).

The floor has no loss recovery: where a datagram of its is lost (an n = 8 rack's queues
overflow now and then), it runs again on the same network, up to three times in all, and the
run's line says so; Gloo's and the appliance's figures on that network stand. With
`--repeat N` it ends with each ratio's median and spread. Exits 1 if a run failed (the floor
lost a datagram three times over, say) or returned a wrong result.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from reduction_appliance.control.config import DataplaneConfig
from reduction_appliance.dataplane.units import format_size
from reduction_appliance.dataplane.wire import HEADER_SIZE, IP_UDP_HEADERS
from reduction_appliance.deploy.testnet.harness import HarnessError, Network, start_appliance
from reduction_appliance.deploy.testnet.probe import MachineTime, descendants, machine_cpu

from .floor_peer import LOST_EXIT
from .gauge import framing, interpreter_ms
from .plan import SweepPlan, parse_sizes, tc_rate, unwritable_output
from .progress import ProgressBar
from .sweep import LabNet, Row, appliance_case, gloo_case, open_network

__all__ = ["FloorLost", "FloorRun", "bounds", "floor_segments", "main", "run_floor",
           "runs_until_one_is_whole", "segment_bytes"]

_PEER = ("-m", "reduction_appliance.bench.floor_peer")
_STEP_TIMEOUT_S = 300.0  # a peer's start, warm-up or timed iterations: generous, never a hang
# The floor has no loss recovery, so a datagram lost (an n = 8 rack's queues overflow now and
# then) ends its run. It runs again on the same network, up to this many times in all, and the
# row says how many runs were lost: Gloo's and the appliance's figures on that network stand.
FLOOR_ATTEMPTS = 3


class FloorLost(HarnessError):
    """A datagram of the floor's was lost: its run has no time (there is no recovery)."""


@dataclass
class FloorRun:
    """One run of the floor on one network."""

    segments: int
    payload: int  # bytes per segment
    times: list[float]  # per timed iteration, its slowest worker's seconds
    ok: bool  # every worker's last result was right
    cpu: MachineTime  # the machine's CPU seconds over the timed iterations
    wall_s: float  # how long the timed iterations took, all of them
    # A worker's receive and send calls in its timed iterations, the median worker's: how
    # many datagrams the kernel handed over per call, how many a GSO send carried.
    worker_receives: int
    worker_sends: int
    worker_cpu_s: float  # the median worker's own CPU seconds (user and kernel) in them
    worker_kernel_cpu_s: float  # ... the kernel's part, the median worker's

    @property
    def time_s(self) -> float:
        return statistics.median(self.times)


def floor_segments(size: int, payload: int) -> int:
    """Whole segments of `size` bytes: the floor moves these, never more than the appliance."""
    if payload <= 0 or size < payload:
        raise ValueError(f"{format_size(size)} is less than one segment of {payload} bytes")
    return size // payload


def segment_bytes(net: Network) -> int:
    """The appliance's own segment size on `net` (what its config derives from the MTU)."""
    return DataplaneConfig(mtu=net.mtu).max_payload


def bounds(gloo_s: float, floor_s: float, kernel_s_per_iter: float,
           cpus: int) -> dict[str, float]:
    """The floor's figures against Gloo's time: the floor's ratio, and the kernel's bound (its
    CPU per iteration spread over every CPU, and the ratio no user space passes)."""
    if min(gloo_s, floor_s) <= 0 or cpus < 1:
        raise ValueError("times are positive and a machine has a CPU")
    kernel_bound_s = kernel_s_per_iter / cpus
    return {"floor_ratio": gloo_s / floor_s, "kernel_bound_s": kernel_bound_s,
            "kernel_ratio": gloo_s / kernel_bound_s if kernel_bound_s > 0 else float("inf")}


def _lines_from(procs: Sequence[subprocess.Popen[str]], key: str, deadline: float) -> list[Row]:
    """The next JSON line of each process, which must hold `key`."""
    got: list[Row] = []
    for proc in procs:
        stream: IO[str] | None = proc.stdout
        assert stream is not None
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        line = stream.readline() if ready else ""
        if not line.startswith("{") or key not in (row := json.loads(line)):
            raise HarnessError(f"a floor peer said {line.strip()!r} where {key!r} was due"
                               if line else f"a floor peer went quiet before {key!r}")
        got.append(row)
    return got


def _tell(procs: Sequence[subprocess.Popen[str]]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()


def run_floor(net: Network, workers: int, size: int, iters: int, warmup: int,
              window: int) -> FloorRun:
    """The floor's peers on `net`: the appliance on appliance 0, a worker per rank."""
    payload = segment_bytes(net)
    segments = floor_segments(size, payload)
    common = ["--workers", str(workers), "--segments", str(segments), "--payload",
              str(payload), "--iters", str(iters), "--warmup", str(warmup)]
    pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE,
                             "stderr": subprocess.PIPE, "text": True}
    procs: list[subprocess.Popen[str]] = []
    try:
        appliance = net.popen_appliance(0, [sys.executable, *_PEER, "appliance", "--bind",
                                            net.appliance_address(0), *common], **pipes)
        procs.append(appliance)
        ranks = [net.popen_worker(rank, [sys.executable, *_PEER, "worker", "--bind",
                                         net.worker_address(rank), "--appliance",
                                         net.appliance_address(0), "--window", str(window),
                                         *common], **pipes)
                 for rank in range(workers)]
        procs += ranks
        _lines_from(procs, "ready", time.monotonic() + _STEP_TIMEOUT_S)
        _tell(procs)
        _lines_from(ranks, "warm", time.monotonic() + _STEP_TIMEOUT_S)
        before, started = machine_cpu(), time.monotonic()
        _tell(ranks)
        reports = _lines_from(ranks, "times", time.monotonic() + _STEP_TIMEOUT_S)
        after, wall = machine_cpu(), time.monotonic() - started
        _lines_from([appliance], "contributions", time.monotonic() + _STEP_TIMEOUT_S)
        for proc in procs:
            proc.wait(timeout=_STEP_TIMEOUT_S)
    except (HarnessError, OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        said = _stderr_of(procs)
        failure = (FloorLost if any(p.returncode == LOST_EXIT for p in procs)
                   else HarnessError)
        raise failure(f"the floor failed: {exc}; {said}") from exc
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    cpu = MachineTime(*(a - b for a, b in zip(after, before, strict=True)))
    times = [max(r["times"][i] for r in reports) for i in range(iters)]
    return FloorRun(segments, payload, times, all(r["ok"] for r in reports), cpu, wall,
                    int(statistics.median(r["receives"] for r in reports)),
                    int(statistics.median(r["sends"] for r in reports)),
                    statistics.median(r["cpu_s"] for r in reports),
                    statistics.median(r["kernel_cpu_s"] for r in reports))


def runs_until_one_is_whole(run: Callable[[], FloorRun], attempts: int = FLOOR_ATTEMPTS,
                            on_lost: Callable[[FloorLost], None] | None = None
                            ) -> tuple[FloorRun, int]:
    """The first of up to `attempts` runs of the floor that lost no datagram, and how many
    before it did. Any other failure ends it at once; so does the last attempt's loss."""
    for lost in range(attempts):
        try:
            return run(), lost
        except FloorLost as exc:
            if lost + 1 == attempts:
                raise FloorLost(f"the floor lost a datagram in each of its {attempts} runs "
                                f"on this network (the last: {exc})") from exc
            if on_lost is not None:
                on_lost(exc)
    raise ValueError(f"attempts must be at least 1, not {attempts}")


def _stderr_of(procs: Sequence[subprocess.Popen[str]]) -> str:
    said = []
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        try:
            _, err = proc.communicate(timeout=5)
        except (subprocess.TimeoutExpired, ValueError):
            continue
        if err.strip():
            said.append(err.strip()[-500:])
    return "; ".join(said) or "no peer said why"


def _plan(args: argparse.Namespace) -> SweepPlan:
    return SweepPlan(network=args.network, workers=(args.workers,),
                     rate=args.rate if args.network == "rack" else None, sizes=(args.size,),
                     dtypes=("fp32",), ops=("sum",), modes=("multicast",), iters=args.iters,
                     warmup=args.warmup, cores=2)


def one_run(plan: SweepPlan, window: int, appliance: bool, progress: ProgressBar) -> Row:
    """Gloo, then the appliance (unless not `appliance`), then the floor, on one network."""
    workers, size = plan.workers[0], plan.sizes[0]
    case = (size, "fp32", "sum")
    net: LabNet
    with open_network(plan, workers) as net:
        floor_segments(size, segment_bytes(net.net))  # (a size too small: said before any run)
        progress.update(label=f"gloo ring, {net.description}")
        gloo = _checked("Gloo", gloo_case(plan, net, workers, 0, case))
        ours: Row | None = None
        if appliance:
            progress.update(label="the appliance")
            with start_appliance(net.net, cores=plan.cores, slots=plan.slots,
                                 queue_target_s=plan.queue_target_s, multicast=True) as appl:
                ours = _checked("the appliance", appliance_case(
                    plan, net, appl, descendants(appl.process.pid), workers, "multicast", 0,
                    case))
        progress.update(label="the floor")
        floor, lost = runs_until_one_is_whole(
            lambda: run_floor(net.net, workers, size, plan.iters, plan.warmup, window),
            on_lost=lambda _: progress.update(label="the floor, again: it lost a datagram"))
        description = net.description
    iterations = len(floor.times)
    moved_gb = floor.segments * floor.payload * iterations / 1e9
    row: Row = {"network": description, "gloo": gloo, "appliance": ours, "floor": asdict(floor),
                "floor_time_s": floor.time_s,
                "floor_kernel_s": floor.cpu.kernel / iterations,
                "floor_user_s": floor.cpu.user / iterations,
                "floor_steal_share": floor.cpu.steal / max(1e-9, sum(floor.cpu)),
                "results_per_receive": floor.segments * iterations / max(1, floor.worker_receives),
                "segments_per_send": floor.segments * iterations / max(1, floor.worker_sends),
                # per GB each rank allreduced, as the appliance's `worker_cpu_s_per_gb`
                "floor_worker_cpu_s_per_gb": floor.worker_cpu_s / moved_gb,
                "floor_worker_kernel_cpu_s_per_gb": floor.worker_kernel_cpu_s / moved_gb,
                "floor_runs_lost": lost}
    row |= bounds(gloo["time_s"], floor.time_s, row["floor_kernel_s"], os.cpu_count() or 1)
    if ours is not None:
        row["appliance_ratio"] = gloo["time_s"] / ours["time_s"]
        row["appliance_of_floor"] = floor.time_s / ours["time_s"]
    if plan.rate_bps:  # the floor's share of a worker's uplink
        wire = floor.segments * (HEADER_SIZE + floor.payload + IP_UDP_HEADERS) * 8
        row["floor_link_util"] = wire / (floor.time_s * plan.rate_bps)
    return row


def _checked(system: str, row: Row) -> Row:
    if row.get("error") or not row["ok"] or not row["time_s"]:
        raise HarnessError(f"{system}'s case failed: {row.get('error') or 'a wrong result'}")
    return row


def format_run(index: int, row: Row) -> str:
    gloo, ours = row["gloo"], row.get("appliance")
    link = (f", {row['floor_link_util']:.0%} of a worker's link"
            if "floor_link_util" in row else "")
    appliance = (f"the appliance {ours['time_s'] * 1e3:.1f} ms (gloo/appliance "
                 f"{row['appliance_ratio']:.2f}x, {row['appliance_of_floor']:.0%} of the "
                 f"floor's speed{_worker_cpu(ours, '')}) | "
                 if ours is not None else "")
    return (f"run {index}: gloo ring {gloo['time_s'] * 1e3:.1f} ms | {appliance}floor "
            f"{row['floor_time_s'] * 1e3:.1f} ms{link}, a worker's "
            f"{row['results_per_receive']:.1f} results per receive and "
            f"{row['segments_per_send']:.1f} segments per send"
            f"{_worker_cpu(row, 'floor_')} (gloo/floor "
            f"{row['floor_ratio']:.2f}x) | the floor's CPU per iteration: kernel "
            f"{row['floor_kernel_s']:.3f} s, user {row['floor_user_s']:.3f} s; the kernel alone "
            f"fills every CPU for {row['kernel_bound_s'] * 1e3:.1f} ms: gloo/that "
            f"{row['kernel_ratio']:.2f}x{_lost_runs(row.get('floor_runs_lost', 0))}")


def _lost_runs(lost: int) -> str:
    if not lost:
        return ""
    return (f" (the floor lost a datagram in {lost} run{'s' if lost > 1 else ''} before this "
            "one on the same network, and ran again)")


def _worker_cpu(row: Row, prefix: str) -> str:
    """A worker's CPU per GB in `row` (keys named `prefix`worker_...), with the kernel's part
    where the row has it."""
    total, kernel = (row.get(f"{prefix}worker_{what}_s_per_gb") for what in ("cpu", "kernel_cpu"))
    if total is None:
        return ""
    return f"; a worker's CPU {total:.2f} s per GB" + (
        "" if kernel is None else f" ({kernel:.2f} s of it kernel)")


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f}; runs "
            f"{', '.join(f'{v:.2f}x' for v in values)})")


def summary(rows: list[Row]) -> str:
    lines = [f"over {len(rows)} runs, median (range):"]
    if all(r.get("appliance_ratio") for r in rows):
        lines.append(f"  gloo/appliance: {_spread([r['appliance_ratio'] for r in rows])}")
    lines += [
        f"  gloo/floor: {_spread([r['floor_ratio'] for r in rows])}: no appliance on these "
        "sockets with more Python than the floor's gets further ahead of Gloo here",
        f"  gloo/(the floor's kernel CPU over every CPU): "
        f"{_spread([r['kernel_ratio'] for r in rows])}: no user-space code gets further ahead "
        "while the kernel carries these bytes",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="reduction_appliance.bench.floor",
                                description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--network", choices=["loopback", "rack"], default="rack")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rate", type=tc_rate, default="10gbit",
                   help="worker link rate in the rack, tc syntax (default: 10gbit)")
    p.add_argument("--size", type=parse_sizes, default=parse_sizes("64MiB"),
                   help="bytes per allreduce (default: 64MiB)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (default: 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations (default: 1)")
    p.add_argument("--window", type=int, default=64,
                   help="segments in flight per worker (default: 64, the appliance's 32 "
                        "slots on each of its 2 cores)")
    p.add_argument("--no-appliance", action="store_true",
                   help="Gloo and the floor only, not the appliance itself")
    p.add_argument("--repeat", type=int, default=1, help="runs, each on a fresh network")
    p.add_argument("--json", type=Path, default=None, help="write every run here")
    args = p.parse_args(argv)
    if (unwritable := unwritable_output(args.json, directory=False)) is not None:
        p.error(unwritable)
    if len(args.size) != 1:
        p.error("--size takes one size")
    args.size = args.size[0]
    if min(args.workers, args.iters, args.window, args.repeat) < 1 or args.warmup < 0:
        p.error("--workers, --iters, --window and --repeat are at least 1, --warmup 0")
    if args.workers < 2:
        p.error("--workers: Gloo ring needs at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("bench.floor needs root: its networks are namespaces", file=sys.stderr)
        return 1
    plan = _plan(args)
    print(f"floor: {args.workers} workers, {format_size(args.size)} fp32 sum, "
          f"{args.network}{f' at {args.rate}' if args.network == 'rack' else ''}, "
          f"{args.iters} timed iterations (+{args.warmup}), {os.cpu_count()} CPUs")
    progress = ProgressBar(args.repeat)
    before = interpreter_ms()
    rows: list[Row] = []
    try:
        for index in range(args.repeat):
            rows.append(one_run(plan, args.window, not args.no_appliance, progress))
            progress.advance()
            progress.clear()
            print(format_run(index + 1, rows[-1]))
    except (HarnessError, ValueError) as exc:
        progress.close()
        print(f"bench.floor failed: {exc}", file=sys.stderr)
        return 1
    progress.close()
    gauge = (before, interpreter_ms())
    if len(rows) > 1:
        print(summary(rows))
    print(framing(*gauge))
    if args.json is not None:
        args.json.write_text(json.dumps({"plan": asdict(plan), "window": args.window,
                                         "gauge_ms": gauge, "runs": rows}, indent=1))
        print(f"wrote {args.json}")
    if not all(r["floor"]["ok"] for r in rows):
        print("bench.floor: a floor worker's result was wrong", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
