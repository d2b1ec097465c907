"""targets.png: every target of bench.targets on one axis, as its figure over its goal.

One bar per target: the median of the runs over the goal (for a cost that must stay under its
goal, the goal over the worst case), a line over the runs' range, green where the target is
met and red where not; the figures and the goal are written under the target's name. Right of
the dashed line at 1 the goal is reached; the axis stops at 1/8 and 8 times the goal (a cost of
zero would be infinitely far). Needs matplotlib (the `plot` extra); rendered with the Agg backend.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: a benchmark host has no display

import matplotlib.pyplot as plt

from .verdicts import Rule, Verdict

__all__ = ["against_goal", "plot_verdicts"]

_TICKS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
_LOW, _HIGH = _TICKS[0], _TICKS[-1]
_COLOURS = {True: "tab:green", False: "tab:red"}


def against_goal(v: Verdict) -> tuple[float, float, float]:
    """(low, middle, high) of the runs over the goal; > 1 is better than the goal."""
    if v.rule is Rule.EVERY_BELOW:  # a cost: the goal over each figure, the worst in the middle
        scaled = sorted(v.goal / x if x > 0 else _HIGH for x in v.values)
        low, middle, high = scaled[0], scaled[0], scaled[-1]
    else:
        scaled = sorted(x / v.goal for x in v.values)
        middle = scaled[0] if v.rule is Rule.EACH else statistics.median(scaled)
        low, high = scaled[0], scaled[-1]
    return _clamped(low), _clamped(middle), _clamped(high)


def _clamped(x: float) -> float:
    return min(_HIGH, max(_LOW, x))


def plot_verdicts(path: Path, verdicts: Sequence[Verdict]) -> Path:
    shown = [v for v in verdicts if v.values]
    fig, ax = plt.subplots(figsize=(11.0, 1.4 + 0.5 * max(1, len(shown))))
    for row, v in enumerate(shown):
        low, middle, high = against_goal(v)
        ax.barh(row, middle, height=0.7, color=_COLOURS[bool(v.met)],
                xerr=[[middle - low], [high - middle]], capsize=2)
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(shown)),
                  [f"{v.target}\n{v.figures()}; goal {v.goal_text()}" for v in shown],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(_LOW, _HIGH)
    ax.set_xticks(_TICKS, [f"{t:g}" for t in _TICKS])
    ax.minorticks_off()
    ax.set_xlabel("figure / goal (the median of the runs; for a cost or a target of each run, "
                  "the worst): right of 1, met")
    ax.set_title("The fast-link targets: green met, red not (line: the runs' range)", fontsize=9)
    fig.tight_layout()
    # tight_layout left the longest label's first letters off the figure: fit the box to it.
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
