"""What a sweep runs, resolved from the command line: one typed, frozen plan.

The options are declared once here and shared by `python -m reduction_appliance.bench.sweep` and
`reductionctl bench`, so the two cannot drift apart.

Sizes take nccl-tests-like ranges and lists: `1KiB:256MiB:x4` (start, stop, times 4),
`64KiB:1MiB:+256KiB` (additive step), `4KiB,64KiB`, or a mix `1KiB:16KiB:x4,1MiB`.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from reduction_appliance.dataplane.dtypes import by_short, short_names
from reduction_appliance.dataplane.units import parse_size
from reduction_appliance.deploy.testnet.topology import RACK_WORKERS_MAX, parse_rate

__all__ = [
    "DEFAULT_SIZES",
    "MAX_TIMED_CALLS",
    "MODES",
    "OPS",
    "SHAPED_TIMED_BYTES",
    "SweepPlan",
    "add_sweep_arguments",
    "choice_list",
    "dtype_list",
    "dtype_name",
    "parse_sizes",
    "plan_from_args",
    "size_list",
    "tc_rate",
]

DEFAULT_SIZES = "1KiB:256MiB:x4"
MODES = ("multicast", "unicast")  # how the appliance fans results out
OPS = ("sum", "avg", "min", "max")
# A range must stay a sweep, not a typo that asks for millions of cases.
_MAX_CASES_PER_RANGE = 1000
# Timed calls that `SweepPlan.min_timed_bytes` adds to a small case, at most: the shaped links'
# bucket matters near its own size (tens of KB to a MB), where this many calls are plenty;
# below, calls are latency-bound and the bucket lends them nothing that matters.
MAX_TIMED_CALLS = 64
# What the benches that judge targets on shaped links time at least per case: 13 times the
# bucket of a 1 Gbit/s link (1.25 MB), 27 times a 500 Mbit/s one's.
SHAPED_TIMED_BYTES = 16 << 20

T = TypeVar("T")


def dtype_name(short: str) -> str:
    """The workers' name of a dtype (float32) from the command line's (fp32)."""
    return by_short(short).name


def _size_range(text: str) -> list[int]:
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"size range {text!r}: expected START:STOP:xFACTOR or START:STOP:+STEP")
    start, stop, step = parse_size(parts[0]), parse_size(parts[1]), parts[2].strip().lower()
    if start <= 0 or stop < start:
        raise ValueError(f"size range {text!r}: need 0 < START <= STOP")
    factor, increment = 1, 0
    if step.startswith("x") and step[1:].isdigit() and int(step[1:]) >= 2:
        factor = int(step[1:])
    elif step.startswith("+") and parse_size(step[1:]) > 0:
        increment = parse_size(step[1:])
    else:
        raise ValueError(f"size range {text!r}: step {step!r} is not xFACTOR (>= 2) or +SIZE")
    sizes = [start]
    while sizes[-1] * factor + increment <= stop:
        sizes.append(sizes[-1] * factor + increment)
        if len(sizes) > _MAX_CASES_PER_RANGE:
            raise ValueError(f"size range {text!r}: more than {_MAX_CASES_PER_RANGE} sizes")
    return sizes


def parse_sizes(text: str) -> list[int]:
    """Sizes in bytes, sorted and without duplicates, from a comma-separated list whose items
    are sizes (`64KiB`) or ranges (`1KiB:256MiB:x4`)."""
    sizes: set[int] = set()
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        sizes.update(_size_range(item) if ":" in item else [parse_size(item)])
    if not sizes or 0 in sizes:
        raise ValueError(f"sizes {text!r}: need at least one positive size")
    return sorted(sizes)


def _arg(parse: Callable[[str], T]) -> Callable[[str], T]:
    """Wrap a parser so argparse reports a ValueError as a usage error (exit status 2)."""
    def wrapped(text: str) -> T:
        try:
            return parse(text)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return wrapped


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of `choices` (a usage error names them)."""
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise ValueError(f"{text!r}: choose from {', '.join(choices)}")
        return list(dict.fromkeys(items))  # keep order, drop repeats
    return _arg(parse)


def dtype_list(text: str) -> list[str]:
    """An argparse type: `dtypes.short_names` (fp32 or float32, ...), a usage error naming the
    choices."""
    return _arg(short_names)(text)


def size_list(text: str) -> list[int]:
    """An argparse type: `parse_sizes`, its ValueError a usage error naming the problem."""
    return _arg(parse_sizes)(text)


def _counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 2 or max(counts) > RACK_WORKERS_MAX:
        raise ValueError(f"worker counts {text!r}: each must be 2..{RACK_WORKERS_MAX} (the "
                         "emulated rack's /24 holds that many workers)")
    return sorted(set(counts))


def tc_rate(text: str) -> str:
    """A link rate in tc's syntax ("500mbit"), validated; kept as spelled for titles and the
    topology."""
    parse_rate(text)
    return text


@dataclass(frozen=True)
class SweepPlan:
    network: str  # "loopback" or "rack"
    workers: tuple[int, ...]
    rate: str | None  # worker link rate in the rack (tc syntax); None on loopback or unshaped
    sizes: tuple[int, ...]
    dtypes: tuple[str, ...]  # reduction_appliance.deploy.testnet.worker names: fp32, fp16, bf16
    ops: tuple[str, ...]
    modes: tuple[str, ...]
    iters: int
    warmup: int
    cores: int
    check: bool = True
    slots: int = 32  # slots per appliance core per job: each worker's window on that core
    queue_target_s: float = 0.025  # jobs.queue_target_s (plugin/congestion.py); 0: fixed windows
    gloo: bool = True
    loss_pct: float = 0.0  # random loss on every worker link, each direction (rack only)
    # ... on the links of these ranks alone (None: every worker's): one bad cable
    lossy_ranks: tuple[int, ...] | None = None
    # The appliance's own link (tc syntax); None: unshaped, standing for its fat uplink. Below
    # workers x rate, every worker's contributions converge on it: an incast.
    appliance_rate: str | None = None
    # A case's timed calls move at least this many bytes together (0: `iters` calls, whatever
    # the size). A shaped link's tbf bucket (deploy/testnet/shaping.py: a hundredth of a second
    # of its rate) lends a short run its bytes at the veth's speed, faster than the link; enough
    # calls after it is spent run at the link's rate. Gloo's cases get the same count.
    min_timed_bytes: int = 0

    def iters_for(self, size: int) -> int:
        """Timed calls of a `size`-byte case: `iters`, or enough to move `min_timed_bytes`
        (at most `MAX_TIMED_CALLS`)."""
        if self.min_timed_bytes <= 0 or size <= 0:
            return self.iters
        return max(self.iters, min(MAX_TIMED_CALLS, -(-self.min_timed_bytes // size)))

    @property
    def rate_bps(self) -> int | None:
        return parse_rate(self.rate) if self.rate else None

    @property
    def appliance_rate_bps(self) -> int | None:
        return parse_rate(self.appliance_rate) if self.appliance_rate else None

    def cases(self) -> list[tuple[int, str, str]]:
        """(size, dtype, op) in run order: per dtype and op, small sizes first."""
        return [(s, d, o) for d in self.dtypes for o in self.ops for s in self.sizes]

    def systems(self, multicast_possible: bool) -> list[str]:
        """The passes of one worker count: appliance modes, then Gloo ring."""
        modes = [m for m in self.modes if multicast_possible or m != "multicast"]
        return modes + (["ring"] if self.gloo else [])

    def total_cases(self, multicast_possible: bool) -> int:
        return len(self.workers) * len(self.systems(multicast_possible)) * len(self.cases())

    def as_dict(self) -> dict[str, object]:
        return asdict(self) | {"rate_bps": self.rate_bps,
                               "appliance_rate_bps": self.appliance_rate_bps}


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--network", choices=["loopback", "rack"], default="rack",
                   help="rack: emulated rack on network namespaces (root); loopback: one "
                        "private namespace's lo (default: rack)")
    p.add_argument("--workers", type=_arg(_counts), default=[4], metavar="N[,N..]",
                   help="worker counts; one network per count (default: 4)")
    p.add_argument("--rate", type=_arg(tc_rate), default="1gbit",
                   help="worker link rate in the rack, tc syntax (default: 1gbit)")
    p.add_argument("--appliance-rate", type=_arg(tc_rate), default=None, metavar="RATE",
                   help="the appliance's link rate in the rack, tc syntax (default: unshaped, "
                        "its fat uplink); below workers x --rate it is an incast")
    p.add_argument("--sizes", type=_arg(parse_sizes), default=parse_sizes(DEFAULT_SIZES),
                   metavar="RANGE|LIST", help=f"bytes per allreduce (default: {DEFAULT_SIZES})")
    p.add_argument("--dtypes", type=dtype_list, default=["fp32"],
                   metavar="fp32,fp16,bf16")
    p.add_argument("--ops", type=choice_list(OPS), default=["sum"], metavar="sum,avg,min,max")
    p.add_argument("--modes", type=choice_list(MODES), default=["multicast"],
                   metavar="multicast,unicast",
                   help="appliance result fan-out (default: multicast)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per case")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per case")
    p.add_argument("--cores", type=int, default=2, help="appliance data-plane cores")
    p.add_argument("--slots", type=int, default=32,
                   help="slots per appliance core per job (jobs.slots): each worker's window "
                        "on that core (default: 32)")
    p.add_argument("--queue-target", type=float, default=0.025, metavar="SECONDS",
                   help="jobs.queue_target_s: a completer's round trip above this shrinks the "
                        "workers' windows (default: 0.025; 0: fixed windows of --slots)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the numpy reference check (it costs seconds at 256 MiB)")
    p.add_argument("--no-gloo", action="store_true", help="appliance only, no Gloo ring pass")
    p.add_argument("--loss", type=float, default=0.0, metavar="PCT",
                   help="random loss on every worker link, each direction, percent (rack)")


def plan_from_args(args: argparse.Namespace) -> SweepPlan:
    if args.iters < 1 or args.warmup < 0 or args.cores < 1 or args.slots < 1:
        raise ValueError("--iters >= 1, --warmup >= 0, --cores >= 1 and --slots >= 1, please")
    if not 0 <= args.queue_target <= 10:
        raise ValueError("--queue-target must be 0..10 seconds (0: fixed windows)")
    return SweepPlan(
        network=args.network, workers=tuple(args.workers),
        rate=args.rate if args.network == "rack" else None, sizes=tuple(args.sizes),
        dtypes=tuple(args.dtypes), ops=tuple(args.ops), modes=tuple(args.modes),
        iters=args.iters, warmup=args.warmup, cores=args.cores, check=not args.no_check,
        slots=args.slots, queue_target_s=args.queue_target, gloo=not args.no_gloo,
        loss_pct=args.loss,
        appliance_rate=args.appliance_rate if args.network == "rack" else None,
    )


def unwritable_output(path: Path | None, *, directory: bool) -> str | None:
    """Why a run's results could not be written to `path` (a directory, or a file), or None;
    the folder is made now. Asked before the run: a bad path found once the results are in
    cost the whole run (`--out /proc/x` failed with a traceback after every case)."""
    if path is None:
        return None
    folder = path if directory else path.parent
    if not directory and path.is_dir():
        return f"{path} is a directory: give a file name for the results"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # (root passes every access check)
            pass
    except OSError as exc:
        return f"cannot write results under {folder}: {exc.strerror or exc}"
    return None
