"""The main job: an appliance and 4 workers on an emulated rack reduce real tensors.

    python -m reduction_appliance.deploy.testnet.demo [--workers 4] [--rate 1gbit]
        [--sizes 1KiB,..,64MiB] [--loopback]

Builds the rack (namespaces, a bridge, MTU 9000 veth links; as root), starts `reductiond` on the
appliance host and one worker process per worker host, allreduces tensors of 1 KiB to 64 MiB in
fp32, fp16 and bf16, checks every result against the numpy reference, and prints size / time /
algbw per case plus the appliance's own counters (one multicast copy out per reduced segment).
Without root it falls back to loopback with unicast results, and says so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from reduction_appliance.dataplane.dtypes import short_names
from reduction_appliance.dataplane.units import format_size, parse_size

from .harness import (
    HarnessError,
    LabNetwork,
    LoopbackNetwork,
    Network,
    run_workers,
    start_appliance,
    worker_argv,
)
from .worker import DTYPE_NAMES

__all__ = ["main"]

T = TypeVar("T")

DEFAULT_SIZES = [1 << s for s in range(10, 27, 2)]  # 1 KiB, 4 KiB, ..., 64 MiB


@contextmanager
def network(args: argparse.Namespace) -> Iterator[Network]:
    if args.loopback or os.geteuid() != 0:
        if not args.loopback:
            print("not root: no emulated rack; running on loopback with unicast results")
        with LoopbackNetwork.create(multicast=not args.unicast) as net:
            yield net
        return
    with LabNetwork.rack(args.workers, multicast=not args.unicast, rate=args.rate) as net:
        print(f"emulated rack: {args.workers} workers at 198.18.0.101.., appliance at "
              f"{net.appliance_address(0)}, bridge, MTU {net.mtu}, worker links "
              f"{args.rate or 'unlimited'}")
        yield net


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with network(args) as net, start_appliance(net, cores=args.cores) as appliance:
        print(f"reductiond up: API {appliance.api}, {args.cores} data-plane cores, results by "
              f"{'multicast' if net.multicast else 'unicast'}")
        options = ["--sizes", ",".join(str(s) for s in args.sizes),
                   "--dtypes", ",".join(args.dtypes), "--iters", str(args.iters)]
        outputs = run_workers(net, worker_argv(net, appliance.api, args.workers, "demo",
                                               options + (["--unicast"] if args.unicast else [])))
        counters = appliance.counters()
    rows = []
    for cases in zip(*outputs, strict=True):
        # An allreduce ends when its last rank has the result: per iteration, the slowest rank.
        per_iter = [max(c["times"][i] for c in cases) for i in range(len(cases[0]["times"]))]
        t = statistics.median(per_iter)
        rows.append({
            "size": cases[0]["size"], "dtype": cases[0]["dtype"], "time_s": t,
            "algbw_gbps": cases[0]["size"] / t / 1e9, "ok": all(c["ok"] for c in cases),
            "retransmissions": sum(c["retransmissions"] for c in cases),
            "segments": sum(c["segments"] for c in cases),
        })
    # retx: segments the ranks sent again (warm-up calls included), and their share of all
    print(f"\n{'size':>10} {'dtype':>9} {'time':>10} {'algbw':>11} {'retx':>13}  check")
    for r in rows:
        share = r["retransmissions"] / max(1, r["segments"])
        print(f"{format_size(r['size']):>10} {r['dtype']:>9} {r['time_s'] * 1e3:8.2f}ms "
              f"{r['algbw_gbps']:7.3f}GB/s {r['retransmissions']:>6} ({share:5.1%})  "
              f"{'exact' if r['ok'] else 'WRONG'}")
    reduced = counters.get("bytes_reduced", 0)
    out = counters.get("bytes_out", 0)
    drops = ", ".join(f"{k}={v}" for k, v in counters.items() if k.startswith("drop_") and v)
    print(f"\nappliance: {counters.get('segments_reduced', 0)} segments reduced, "
          f"{format_size(reduced)} of results, {format_size(out)} sent "
          f"({out / max(1, reduced):.2f} bytes out per result byte incl. headers and resends; "
          f"unicast fan-out would be ~{args.workers}); drops: {drops or 'none'}")
    return rows


def _usage(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse`, its ValueError a usage error naming the problem (argparse's own says only
    "invalid value")."""
    def wrapped(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return wrapped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="reduction_appliance.deploy.testnet.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--cores", type=int, default=2, help="appliance data-plane cores")
    p.add_argument("--rate", default=None, help="worker link rate, e.g. 1gbit (default: none)")
    p.add_argument("--sizes", type=_usage(lambda s: [parse_size(x) for x in s.split(",")]),
                   default=DEFAULT_SIZES, metavar="1KiB,..,64MiB")
    p.add_argument("--dtypes", type=_usage(short_names), default=list(DTYPE_NAMES),
                   metavar="fp32,fp16,bf16")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--unicast", action="store_true", help="unicast fan-out instead of multicast")
    p.add_argument("--loopback", action="store_true", help="no rack: everything on loopback")
    args = p.parse_args(argv)
    try:
        rows = run(args)
    except HarnessError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    if not all(r["ok"] for r in rows):
        print("some results differ from the numpy reference", file=sys.stderr)
        return 1
    print(f"\nall {len(rows)} cases exact against the numpy reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
