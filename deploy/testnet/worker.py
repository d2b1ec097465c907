"""One worker of an appliance run: register, allreduce every case, check, print JSON lines.

    python -m reduction_appliance.deploy.testnet.worker --appliance 198.18.0.1:7070 \\
        --job demo --world 4 --rank 0 --local 198.18.0.101 --sizes 1KiB,64MiB --dtypes fp32

Every rank builds every rank's input from the same seeds, so each can compute the numpy
reference on its own and check its result bit for bit: integer-valued inputs in arrival-order
mode (exact in any order), random floats in deterministic mode (rank-order fp32 summation).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from reduction_appliance.dataplane.dtypes import DTYPES, info
from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.dataplane.units import parse_size
from reduction_appliance.dataplane.wire import DType, Op
from reduction_appliance.plugin.client import ApplianceClient
from reduction_appliance.plugin.rendezvous import leave, register
from reduction_appliance.plugin.rtt import Timing
from reduction_appliance.plugin.slotplan import Repairs

from .probe import Probe
from .reference import integer_valued, random_values, reference, same_bits

__all__ = ["DTYPE_NAMES", "add_probe_arguments", "case_arguments", "main", "probe_of"]

DTYPE_NAMES = {d.short: d.dtype for d in DTYPES}


def _list(kind: Callable[[str], Any], names: dict[str, Any] | None = None) -> Any:
    def parse(text: str) -> list[Any]:
        items = [x for x in text.split(",") if x]
        if names is not None:
            bad = [x for x in items if x not in names]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {sorted(names)}")
            return [names[x] for x in items]
        try:
            return [kind(x) for x in items]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return parse


def case_arguments(p: argparse.ArgumentParser) -> None:
    """The cases to run, shared with bench.gloo_worker so both run the same ones."""
    p.add_argument("--sizes", type=_list(parse_size), default=[1 << 20])
    p.add_argument("--dtypes", type=_list(str, DTYPE_NAMES), default=[DType.FLOAT32])
    p.add_argument("--ops", type=_list(str, {o.name.lower(): o for o in Op}), default=[Op.SUM])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-check", action="store_true", help="skip the reference (big sweeps)")


def add_probe_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared with bench.gloo_worker: what to sample around each timed call."""
    p.add_argument("--probe-link", default=None, metavar="IFNAME",
                   help="sum this interface's rx/tx bytes over the timed calls")
    p.add_argument("--probe-pids", type=_list(int), default=[], metavar="PID,..",
                   help="sum these processes' CPU seconds over the timed calls")
    p.add_argument("--probe-machine", action="store_true",
                   help="sum the machine's user and kernel CPU seconds over the timed calls")


def probe_of(args: argparse.Namespace) -> Probe:
    return Probe(args.probe_link, tuple(args.probe_pids), machine=args.probe_machine)


def inputs(seed: int, case: int, rank: int, n: int, dtype: DType,
           deterministic: bool) -> np.ndarray:
    rng = np.random.default_rng([seed, case, rank])
    return (random_values if deterministic else integer_valued)(rng, n, dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reduction_appliance.deploy.testnet.worker",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--appliance", action="append", required=True, help="API HOST:PORT")
    p.add_argument("--job", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local", default="0.0.0.0", help="this worker's data address")
    case_arguments(p)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--unicast", action="store_true", help="results by unicast fan-out")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds per allreduce")
    p.add_argument("--token-file", help="the appliance API's bearer token")
    p.add_argument("--secret", required=True, help="the job's join secret (every rank's)")
    p.add_argument("--rejoin", action="store_true",
                   help="a restarted rank: retire its old endpoint, start a new epoch")
    p.add_argument("--leave", action="store_true", help="leave the job at the end")
    add_probe_arguments(p)
    args = p.parse_args(argv)

    try:
        token = Path(args.token_file).read_text().strip() if args.token_file else None
        registered = [register(a, args.job, args.world, secret=args.secret, token=token,
                               deterministic=args.deterministic, multicast=not args.unicast)
                      for a in args.appliance]
        timing = Timing(deadline=args.deadline)
        with ApplianceClient(registered, args.rank, local_address=args.local, timing=timing,
                             rejoin=args.rejoin) as client:
            jobs = client.jobs
            case = 0
            for dtype in args.dtypes:
                for size in args.sizes:
                    for op in args.ops:
                        case += 1
                        row = _run_case(client, args, case, dtype, size, op)
                        row["job_ids"] = [job.job_id for job in jobs]
                        print(json.dumps(row), flush=True)
        if args.leave:
            for job in jobs:
                leave(job, args.rank)
    except ReductionError as exc:
        print(f"rank {args.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    return 0


def _run_case(client: ApplianceClient, args: argparse.Namespace, case: int, dtype: DType,
              size: int, op: Op) -> dict[str, Any]:
    itemsize = dtype.itemsize
    n = max(1, size // itemsize)
    mine = inputs(args.seed, case, args.rank, n, dtype, args.deterministic)
    want = None
    if not args.no_check:
        want = reference([
            mine if r == args.rank else inputs(args.seed, case, r, n, dtype, args.deterministic)
            for r in range(args.world)
        ], op)
    work = np.empty_like(mine)
    times: list[float] = []
    bad = 0
    repairs_before = client.repairs
    window = client.pipeline.window  # the congestion window (None: fixed windows)
    cuts_before = window.cuts if window is not None else 0
    probe = probe_of(args)
    # this process's CPU time in the timed calls (its heartbeat thread included), and the
    # kernel's part of it (its system calls: sends, receives, waits)
    cpu_s = kernel_s = 0.0
    for i in range(args.warmup + args.iters):
        np.copyto(work, mine)
        timed = i >= args.warmup
        if timed:
            probe.before()
        cpu_start = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        client.allreduce(work, op)
        elapsed = time.perf_counter() - start
        if timed:
            cpu_end = resource.getrusage(resource.RUSAGE_SELF)
            cpu_s += cpu_end.ru_utime + cpu_end.ru_stime - cpu_start.ru_utime - cpu_start.ru_stime
            kernel_s += cpu_end.ru_stime - cpu_start.ru_stime
            probe.after(elapsed)
            times.append(elapsed)
        if want is not None and not same_bits(work, want):
            bad += 1
    return {
        "rank": args.rank, "size": n * itemsize, "dtype": dtype.name.lower(),
        "op": op.name.lower(), "times": times, "checked": want is not None,
        "ok": bad == 0, "bad_iterations": bad,
        "retransmissions": client.repairs.total - repairs_before.total,
        # ... by what sent them (plugin.slotplan.Repairs)
        "repairs": {field: now - then for field, now, then
                    in zip(Repairs._fields, client.repairs, repairs_before, strict=True)},
        "segments": -(-(n * itemsize) // client.segment_bytes) * (args.warmup + args.iters),
        "worker_cpu_s": cpu_s, "worker_kernel_cpu_s": kernel_s,
        # the window per core its receive buffer holds, where fewer than the slots (else None)
        "window_cap": client.window_cap,
        # the congestion window: its cuts in this case, and the least any core's came to
        **({"window_cuts": window.cuts - cuts_before, "window_least": window.least}
           if window is not None else {}),
        "numpy_dtype": str(info(dtype).numpy), **probe.report(),
    }


if __name__ == "__main__":
    sys.exit(main())
