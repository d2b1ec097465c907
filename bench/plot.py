"""algbw.png: algbw against size, one panel per worker count and dtype/op, one line per system
and mode, with the rate-limited rack's bounds drawn in (see bench.report.bounds_gbps).

Needs matplotlib (the `plot` extra); rendered with the Agg backend, so no display is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: a benchmark host has no display

import matplotlib.pyplot as plt

from reduction_appliance.dataplane.units import format_size

from .plan import SweepPlan
from .report import bounds_gbps, burst_bytes

__all__ = ["plot_algbw"]

_PANEL_SIZE = (8.0, 4.5)  # inches
_DPI = 110
_STYLE = {  # (system, mode) -> line style
    ("appliance", "multicast"): {"color": "tab:blue", "marker": "o"},
    ("appliance", "unicast"): {"color": "tab:green", "marker": "s"},
    ("gloo", "ring"): {"color": "tab:red", "marker": "^"},
}


def plot_algbw(path: Path, plan: SweepPlan, rows: list[dict[str, Any]]) -> Path:
    panels = sorted({(r["workers"], r["dtype"], r["op"]) for r in rows})
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(_PANEL_SIZE[0], _PANEL_SIZE[1] * len(panels)))
    sizes = sorted({r["size"] for r in rows})
    for ax, (workers, dtype, op) in zip(axes[:, 0], panels, strict=True):
        mine = [r for r in rows if (r["workers"], r["dtype"], r["op"]) == (workers, dtype, op)]
        for system, mode in sorted({(r["system"], r["mode"]) for r in mine}):
            points = sorted((r["size"], r["algbw_gbps"]) for r in mine
                            if (r["system"], r["mode"]) == (system, mode) and r["algbw_gbps"])
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points],
                        label=f"{system} {mode}", **_STYLE.get((system, mode), {}))
        if plan.rate_bps:
            bounds = bounds_gbps(plan.rate_bps, workers, plan.appliance_rate_bps)
            for (name, bound), style in zip(bounds.items(), ("--", ":"), strict=True):
                formula = ("R / (2(n-1)/n)" if name == "gloo ring" else
                           "min(R, appliance link / n)" if plan.appliance_rate else "R")
                ax.axhline(bound, color="grey", linestyle=style,
                           label=f"{name} bound {formula} = {bound:.4g} GB/s")
            burst = burst_bytes(plan.rate_bps)
            ax.axvline(burst, color="lightgrey", linestyle="-.",
                       label=f"tbf burst {format_size(burst)}: smaller sizes pass unshaped")
        where = (f"rack, worker links {plan.rate}"
                 f"{f', appliance link {plan.appliance_rate}' if plan.appliance_rate else ''}"
                 if plan.network == "rack" else "loopback")
        ax.set_title(f"allreduce algbw: {where}, n = {workers} workers, {dtype} {op}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=45, fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("bytes per allreduce")
        ax.set_ylabel("algbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path
