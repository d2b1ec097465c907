"""floor.png: bench.floor's runs of several cases side by side, as ratios against Gloo ring.

    python -m reduction_appliance.bench.floor_plot docs/floor/floor.png \\
        docs/floor/n4-1gbit-64MiB.json:1.45 docs/floor/n4-10gbit-64MiB.json:1.3 ...

Each argument after the image is a `bench.floor --json` file, optionally with the issue's target
ratio for that case after a colon. Per case, three bars against Gloo in the same runs (the median
of the runs, a line over their range): the appliance, the floor (its traffic with the least
Python), and the kernel's bound (the floor's kernel CPU spread over every CPU); the target as a
mark, and Gloo's own 1.0x as a line. Reading across a case: how far the appliance is from the
floor is our protocol's Python; how far the floor is from the kernel's bound is the least Python
any appliance needs; a target right of the kernel's bound is out of reach of any user-space code
on this machine.

Needs matplotlib (the `plot` extra); rendered with the Agg backend, so no display is needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reduction_appliance.dataplane.units import format_size

__all__ = ["Case", "case_of", "main", "plot_cases"]

_BARS = (  # (row key, label, colour)
    ("appliance_ratio", "the appliance", "tab:blue"),
    ("floor_ratio", "the floor: its traffic, least Python", "tab:orange"),
    ("kernel_ratio", "the kernel's bound: its CPU for that traffic", "tab:gray"),
)


_TICKS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0)


@dataclass(frozen=True)
class Case:
    label: str
    ratios: dict[str, list[float]]  # row key -> one ratio per run
    target: float | None


def case_of(written: dict[str, Any], target: float | None = None) -> Case:
    """One case from what `bench.floor --json` wrote."""
    plan, runs = written["plan"], written["runs"]
    if not runs:
        raise ValueError("no runs in it")
    where = "loopback" if plan["network"] == "loopback" else plan["rate"] or "unshaped"
    label = f"n = {plan['workers'][0]}, {where}, {format_size(plan['sizes'][0])}"
    ratios = {key: [r[key] for r in runs] for key, _, _ in _BARS
              if all(r.get(key) is not None for r in runs)}
    return Case(label, ratios, target)


def plot_cases(path: Path, cases: Sequence[Case]) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: a benchmark host has no display
    import matplotlib.pyplot as plt

    height = 0.26
    fig, ax = plt.subplots(figsize=(9.0, 1.8 + 1.1 * len(cases)))
    for slot, (key, label, colour) in enumerate(_BARS):
        ys, medians, lows, highs = [], [], [], []
        for row, case in enumerate(cases):
            values = case.ratios.get(key)
            if not values:
                continue
            median = statistics.median(values)
            ys.append(row + (slot - 1) * height)
            medians.append(median)
            lows.append(median - min(values))
            highs.append(max(values) - median)
        ax.barh(ys, medians, height=height * 0.9, color=colour, label=label,
                xerr=[lows, highs], capsize=2)
        for y, median, high in zip(ys, medians, highs, strict=True):
            ax.text(median + high, y, f"  {median:.2f}x", va="center", fontsize=7)
    targets = [(row, case.target) for row, case in enumerate(cases) if case.target]
    if targets:
        ax.scatter([t for _, t in targets], [row for row, _ in targets], marker="|", s=900,
                   linewidths=2, color="tab:red", zorder=3, label="the issue's target")
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(cases)), [case.label for case in cases])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xticks(_TICKS, [f"{t:g}x" for t in _TICKS])
    ax.minorticks_off()
    ax.set_xlabel("Gloo ring's time / this one's (same network, same run; > 1: faster than Gloo)")
    ax.set_title("How far ahead of Gloo: the appliance, its traffic with the least Python, and "
                 "the kernel's CPU for it", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _argument(text: str) -> tuple[Path, float | None]:
    name, _, target = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        return Path(name), float(target) if target else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: FILE or FILE:TARGET (a ratio)") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="reduction_appliance.bench.floor_plot",
                                description=__doc__.split("\n\n", 1)[0])
    p.add_argument("image", type=Path, help="the PNG to write")
    p.add_argument("runs", type=_argument, nargs="+", metavar="FILE[:TARGET]",
                   help="bench.floor --json files, each with its case's target ratio")
    args = p.parse_args(argv)
    cases = []
    for path, target in args.runs:
        try:
            cases.append(case_of(json.loads(path.read_text()), target))
        except (OSError, ValueError, KeyError, IndexError) as exc:
            print(f"floor_plot: {path}: not bench.floor's output ({exc})", file=sys.stderr)
            return 1
    print(f"wrote {plot_cases(args.image, cases)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
