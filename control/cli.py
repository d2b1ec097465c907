"""reductionctl: the operator's command line. Parsing and dispatch only; the work is done by
deploy.testnet (standing labs) and bench (the sweep).

    reductionctl lab up --workers 4 [--appliances 1] [--rate 1gbit] [--loss PCT] [--mtu 9000]
                        [--name PREFIX] [--json]
    reductionctl lab down PREFIX [PREFIX ..] | --all
    reductionctl lab list [--json]
    reductionctl bench [--network rack|loopback] [--workers 4,8] [--rate 500mbit]
                       [--sizes 1KiB:64MiB:x4] [--modes multicast,unicast] [--out results/] ..

Exit status: 0 done, 1 failed (the message says what), 2 bad usage.

An entry point sits above the layers it drives: deploy and bench are imported inside functions
only, so importing `control` never pulls them (or pyroute2, numpy, torch) in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from . import ctl

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _need_root(what: str) -> str | None:
    if os.geteuid() != 0:
        return f"{what} needs root (network namespaces: CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    return None


def _fail(message: str, status: int = EXIT_FAILED) -> int:
    print(f"reductionctl: {message}", file=sys.stderr)
    return status


# -- lab ------------------------------------------------------------------------------------------

def lab_up(args: argparse.Namespace) -> int:
    from deploy.testnet import LabError, Topology
    from deploy.testnet.standing import up

    if (why := _need_root("lab up")) is not None:
        return _fail(why)
    try:
        topology = Topology.rack(args.workers, args.appliances, rate=args.rate,
                                 loss_pct=args.loss, mtu=args.mtu, prefix=args.name)
    except ValueError as exc:
        return _fail(str(exc), EXIT_USAGE)
    try:
        record = up(topology, args.state_dir)
    except LabError as exc:
        return _fail(str(exc))
    info = record.describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    a0, w0 = info["hosts"][0], info["hosts"][record.appliances]
    print(f"lab {record.name} is up: {record.appliances} appliance(s), {record.workers} workers "
          f"on one bridge (namespace {info['switch_netns']}), subnet {info['subnet']}")
    print(f"worker links {record.rate or 'unshaped'}"
          f"{f', {record.loss_pct}% loss' if record.loss_pct else ''}, MTU {record.mtu}; "
          f"appliance links unshaped\n")
    print(f"  {'host':<5} {'address':<15} {'namespace':<20} interface")
    for host in info["hosts"]:
        print(f"  {host['name']:<5} {host['address']:<15} {host['netns']:<20} {host['ifname']}")
    print(f"\nrun a command on a host:  ip netns exec {w0['netns']} ping -c1 {a0['address']}")
    print(f"start an appliance:       ip netns exec {a0['netns']} reductiond --config FILE")
    print(f"tear it down:             reductionctl lab down {record.name}")
    return EXIT_OK


def lab_down(args: argparse.Namespace) -> int:
    from deploy.testnet import LabError
    from deploy.testnet.standing import down, list_labs

    if (why := _need_root("lab down")) is not None:
        return _fail(why)
    if bool(args.names) == args.all:
        return _fail("lab down: name one or more labs, or --all", EXIT_USAGE)
    try:
        names = [r.name for r in list_labs(args.state_dir)] if args.all else args.names
        status = EXIT_OK
        for name in names:
            try:
                removed = down(name, args.state_dir)
            except LabError as exc:
                status = _fail(str(exc))
                continue
            print(f"lab {name} down ({len(removed)} namespaces removed)")
    except LabError as exc:
        return _fail(str(exc))
    if args.all and not names:
        print("no standing labs")
    return status


def lab_list(args: argparse.Namespace) -> int:
    from deploy.testnet import LabError
    from deploy.testnet.standing import list_labs

    try:
        labs = [r.describe() for r in list_labs(args.state_dir)]
    except LabError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(labs, indent=2))
        return EXIT_OK
    if not labs:
        print("no standing labs (reductionctl lab up --workers N)")
        return EXIT_OK
    print(f"{'name':<14} {'state':<8} {'appl':>4} {'workers':>7} {'rate':<10} {'mtu':>5}  created")
    for lab in labs:
        print(f"{lab['name']:<14} {lab['state']:<8} {lab['appliances']:>4} {lab['workers']:>7} "
              f"{lab['rate'] or 'unshaped':<10} {lab['mtu']:>5}  {lab['created']}")
    return EXIT_OK


# -- bench ----------------------------------------------------------------------------------------

def bench(args: argparse.Namespace) -> int:
    from bench.sweep import sweep_main

    return sweep_main(args)


# -- parsing --------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    from bench.plan import add_sweep_arguments
    from bench.sweep import add_output_arguments

    p = argparse.ArgumentParser(prog="reductionctl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(
        dest="command", required=True,
        metavar="{status,jobs,abort,check-config,steering,clean,lab,bench}")
    ctl.add_commands(sub)

    lab = sub.add_parser("lab", help="emulated racks on network namespaces (root)")
    lab.add_argument("--state-dir", type=Path, default=Path("/run/reduction-appliance/labs"),
                     help=argparse.SUPPRESS)
    labs = lab.add_subparsers(dest="lab_command", required=True, metavar="{up,down,list}")
    lab_up_p = labs.add_parser("up", help="build a rack that stays up")
    lab_up_p.add_argument("--workers", type=int, required=True)
    lab_up_p.add_argument("--appliances", type=int, default=1)
    lab_up_p.add_argument("--rate", default=None, help="worker link rate, tc syntax (1gbit)")
    lab_up_p.add_argument("--loss", type=float, default=0.0, help="worker link loss, percent")
    lab_up_p.add_argument("--mtu", type=int, default=9000)
    lab_up_p.add_argument("--name", default=None,
                          help="name prefix of every namespace/interface (default: generated)")
    lab_up_p.add_argument("--json", action="store_true", help="print the lab as JSON")
    lab_up_p.set_defaults(run=lab_up)
    lab_down_p = labs.add_parser("down", help="tear standing labs down")
    lab_down_p.add_argument("names", nargs="*", metavar="PREFIX")
    lab_down_p.add_argument("--all", action="store_true", help="every standing lab")
    lab_down_p.set_defaults(run=lab_down)
    lab_list_p = labs.add_parser("list", help="standing labs and their state")
    lab_list_p.add_argument("--json", action="store_true")
    lab_list_p.set_defaults(run=lab_list)

    bench_p = sub.add_parser(
        "bench", help="allreduce sweep: appliance vs Gloo ring on one network",
        description="An nccl-tests-style sweep (see bench.sweep): per worker count one "
                    "network, the appliance per fan-out mode, then Gloo ring, same cases.")
    add_sweep_arguments(bench_p)
    add_output_arguments(bench_p)
    bench_p.set_defaults(run=bench)
    return p


def _operator(args: argparse.Namespace) -> int:
    return ctl.run(args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = getattr(args, "run", _operator)
    try:
        return run(args)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
