"""`reductionctl lab`: emulated racks that outlive the command (root).

    reductionctl lab up --workers 4 [--appliances 1] [--rate 1gbit] [--loss PCT] [--mtu 9000]
                        [--name PREFIX] [--json]
    reductionctl lab down PREFIX [PREFIX ..] | --all
    reductionctl lab list [--json]
    reductionctl lab roce [--rxe N] [--timeout S] -- COMMAND [ARGS...]

Exit status: 0 done, 1 failed (the message says what), 2 bad usage. Loaded by reductionctl only
when the command is `lab` (the lab sits above the control plane; see docs/architecture.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from .lab import LabError
from .standing import STATE_DIR, down, list_labs, orphaned_labs, up
from .topology import Topology

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _need_root(what: str) -> str | None:
    if os.geteuid() != 0:
        return f"{what} needs root (network namespaces: CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    return None


def _fail(message: str, status: int = EXIT_FAILED) -> int:
    print(f"reductionctl: {message}", file=sys.stderr)
    return status


def lab_up(args: argparse.Namespace) -> int:
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
    try:
        labs = [r.describe() for r in list_labs(args.state_dir)]
    except LabError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(labs, indent=2))
        return EXIT_OK
    if not labs:
        print("no standing labs (reductionctl lab up --workers N)")
    else:
        print(f"{'name':<14} {'state':<8} {'appl':>4} {'workers':>7} {'rate':<10} {'mtu':>5}  "
              "created")
    for lab in labs:
        print(f"{lab['name']:<14} {lab['state']:<8} {lab['appliances']:>4} {lab['workers']:>7} "
              f"{lab['rate'] or 'unshaped':<10} {lab['mtu']:>5}  {lab['created']}")
    # A run killed outright (SIGKILL, out of memory) could not tear its rack down: say so
    # where a person looks for labs, with the command that removes it.
    for prefix, names in orphaned_labs(args.state_dir).items():
        print(f"left by a run that is gone: {prefix} ({len(names)} namespaces); "
              f"`reductionctl lab down {prefix}` removes it")
    return EXIT_OK


GUEST = Path(__file__).resolve().parents[1] / "roce" / "guest.sh"


def lab_roce(args: argparse.Namespace) -> int:
    """COMMAND with soft-RoCE devices rxe1..N (10.77.0.1..N): inside the project's QEMU guest
    (deploy/roce/guest.sh), whose kernel has rdma_rxe whatever this host's has. Its exit status
    is ours; 124: timed out, 125: the lab itself failed."""
    if (why := _need_root("lab roce")) is not None:
        return _fail(why)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        return _fail("lab roce: give the command to run after --", EXIT_USAGE)
    if not 1 <= args.rxe <= 16:
        return _fail("lab roce: --rxe must be 1..16", EXIT_USAGE)
    return subprocess.run(["bash", str(GUEST), "run", "--rxe", str(args.rxe), "--timeout",
                           str(args.timeout), "--", *command], check=False).returncode


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reductionctl lab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-dir", type=Path, default=STATE_DIR, help=argparse.SUPPRESS)
    labs = p.add_subparsers(dest="lab_command", required=True, metavar="{up,down,list,roce}")
    up_p = labs.add_parser("up", help="build a rack that stays up")
    up_p.add_argument("--workers", type=int, required=True)
    up_p.add_argument("--appliances", type=int, default=1)
    up_p.add_argument("--rate", default=None, help="worker link rate, tc syntax (1gbit)")
    up_p.add_argument("--loss", type=float, default=0.0, help="worker link loss, percent")
    up_p.add_argument("--mtu", type=int, default=9000)
    up_p.add_argument("--name", default=None,
                      help="name prefix of every namespace/interface (default: generated)")
    up_p.add_argument("--json", action="store_true", help="print the lab as JSON")
    up_p.set_defaults(run=lab_up)
    down_p = labs.add_parser("down", help="tear standing labs down")
    down_p.add_argument("names", nargs="*", metavar="PREFIX")
    down_p.add_argument("--all", action="store_true", help="every standing lab")
    down_p.set_defaults(run=lab_down)
    list_p = labs.add_parser("list", help="standing labs and their state")
    list_p.add_argument("--json", action="store_true")
    list_p.set_defaults(run=lab_list)
    roce_p = labs.add_parser("roce", help="run a command where soft-RoCE devices exist (a guest)")
    roce_p.add_argument("--rxe", type=int, default=4, help="devices rxe1..N on 10.77.0.1..N")
    roce_p.add_argument("--timeout", type=int, default=3600, help="seconds, boot included")
    roce_p.add_argument("command", nargs=argparse.REMAINDER)
    roce_p.set_defaults(run=lab_roce)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
