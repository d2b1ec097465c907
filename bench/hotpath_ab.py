"""This tree's data-path Python against another tree's, measured in pairs, interleaved.

    git worktree add /tmp/base HEAD~1
    python -m reduction_appliance.bench.hotpath_ab /tmp/base [--pairs 30] [--side worker]

`bench.hotpath`'s figures move by 30% or more from one minute to the next on this machine, so
two trees measured one after the other compare the machine's moods, not the code. Here each
tree runs in a process of its own (its package first on the path), kept warm, and the two take
turns: one `bench.hotpath` measurement of `--side` (a worker's us per segment, or the
appliance's us per datagram) from each, the order swapped every pair, so a drift of the machine
lands on both. What counts is each pair's ratio, this tree's figure over the other's; the
median and quartiles of those ratios are printed (below 1: this tree spends less).

The other tree only needs `bench.hotpath` with `worker_us_per_segment` and
`appliance_us_per_datagram` (every tree since 2026-11-28), so any older commit can be checked
out and compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import reduction_appliance

from .gauge import framing, interpreter_ms
from .progress import ProgressBar

__all__ = ["Comparison", "compare", "main", "tree_of"]

# What each side's process runs: the tree's own `bench.hotpath`, one figure per line asked.
_SERVE = """
import sys
from reduction_appliance.bench import hotpath
measure = {"worker": hotpath.worker_us_per_segment,
           "appliance": hotpath.appliance_us_per_datagram}[sys.argv[1]]
measure()  # warm: imports, first allocations
print("ready", hotpath.__file__, flush=True)
for _ in sys.stdin:
    print(repr(measure()), flush=True)
"""
_UNITS = {"worker": "us per segment", "appliance": "us per datagram"}


def tree_of(path: Path) -> Path:
    """The root of the checkout at `path` (the folder holding its `reduction_appliance`
    package); ValueError with the reason when it holds none."""
    root = path.resolve()
    if not (root / "reduction_appliance" / "__init__.py").is_file():
        raise ValueError(f"{path} holds no reduction_appliance package (give a checkout's "
                         "root, e.g. one made by `git worktree add`)")
    return root


@dataclass
class Comparison:
    ours: list[float]
    theirs: list[float]

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.ours, self.theirs, strict=True)]

    def summary(self, side: str, other: Path) -> str:
        ratios = sorted(self.ratios)
        low, _, high = (statistics.quantiles(ratios, n=4) if len(ratios) > 1
                        else (ratios[0],) * 3)
        unit = _UNITS[side]
        return "\n".join([
            f"{side}, {len(ratios)} pairs: this tree min {min(self.ours):.2f}, median "
            f"{statistics.median(self.ours):.2f} {unit}; {other} min {min(self.theirs):.2f}, "
            f"median {statistics.median(self.theirs):.2f}",
            f"this tree / {other}, paired: median {statistics.median(ratios):.3f} (quartiles "
            f"{low:.3f}-{high:.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f}); below 1: this "
            "tree spends less",
        ])


class _Side:
    """One tree's measuring process."""

    def __init__(self, root: Path, side: str) -> None:
        self.root = root
        env = dict(os.environ, PYTHONPATH=str(root))
        self.process = subprocess.Popen([sys.executable, "-c", _SERVE, side], cwd=root,
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        said = self._line()
        # The tree's own package, not whatever else is installed: else both sides are one.
        if not said.startswith("ready ") or not Path(said[6:]).resolve().is_relative_to(root):
            raise RuntimeError(f"the measuring process of {root} said {said!r}")

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the measuring process of {self.root} ended "
                               f"(exit {self.process.wait()})")
        return line.strip()

    def measure(self) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def compare(other: Path, side: str, pairs: int, progress: ProgressBar | None = None
            ) -> Comparison:
    """`pairs` measurements of `side` from this tree and from `other`, interleaved."""
    ours_root = tree_of(Path(reduction_appliance.__file__).parent.parent)
    sides = [_Side(ours_root, side)]
    try:
        sides.append(_Side(tree_of(other), side))
        result = Comparison([], [])
        for pair in range(pairs):
            first = pair % 2  # ABBA: the order swapped every pair
            figures = {first: sides[first].measure()}
            figures[1 - first] = sides[1 - first].measure()
            result.ours.append(figures[0])
            result.theirs.append(figures[1])
            if progress is not None:
                progress.advance(f"pair {pair + 1}: {figures[0] / figures[1]:.3f}")
        return result
    finally:
        for s in sides:
            s.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reduction_appliance.bench.hotpath_ab",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="the root of another checkout to compare with")
    parser.add_argument("--pairs", type=int, default=30, help="measurements of each tree")
    parser.add_argument("--side", choices=sorted(_UNITS), default="worker",
                        help="whose Python: a worker's per segment (default) or the "
                             "appliance's per datagram")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    try:
        tree_of(args.other)
    except ValueError as exc:
        parser.error(str(exc))
    before = interpreter_ms()
    progress = ProgressBar(args.pairs)
    try:
        result = compare(args.other, args.side, args.pairs, progress)
    except RuntimeError as exc:  # a tree whose bench.hotpath cannot run: said, not a traceback
        print(f"hotpath_ab: {exc}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    print(framing(before, interpreter_ms()))
    print(result.summary(args.side, args.other))
    return 0


if __name__ == "__main__":
    sys.exit(main())
