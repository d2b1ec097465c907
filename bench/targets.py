"""Every target of the fast-link issue in one command: the benchmarks that prove them, run one
after the other on a quiet machine, then one verdict per target (median of the runs, the range,
the worst run) and a plot.

    python -m reduction_appliance.bench.targets [--repeat 3] [--only STEP,...] [--out DIR]
    python -m reduction_appliance.bench.targets --report DIR      # judge saved runs again

The steps (each a shipped benchmark, run as its own process, its output shown as it runs):

    loopback         allreduce --network loopback --repeat R
    rack-1gbit       allreduce --network rack --rate 1gbit --sizes 64MiB --repeat R
    rack-n8-500mbit  allreduce --network rack --workers 8 --rate 500mbit --sizes 1MiB,64MiB
                     --repeat R
    rack-10gbit      allreduce --network rack --rate 10gbit --sizes 4MiB,64MiB --repeat R
    loss             loss --repeat R
    ddp-1gbit        ddp_steps --workers 4 --rate 1gbit --steps 300, R times
    ddp-500mbit      ddp_steps --workers 4 --rate 500mbit --steps 300, R times

Each writes its JSON under DIR (default results/targets-<UTC time>); DIR/targets.json holds the
verdicts and the steps' exit statuses and times, DIR/targets.png the plot (with matplotlib, the
`plot` extra), and the table is printed in Markdown, ready for docs/benchmarks.md. A step that
fails leaves its targets "not measured" and the others still run. Exits 1 when a step failed or a
result was not exact, 0 otherwise: whether the targets are met is the table's to say, since on
two shared cores it follows the machine's speed (each step's `bench.gauge` figures are listed).
Takes about 20 minutes at --repeat 3 here and needs root (the racks are network namespaces).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from reduction_appliance.deploy.testnet.unwind import unwinding_on_termination

from .progress import format_duration
from .verdicts import Verdict, all_verdicts, cost_table, exactness, markdown_table

__all__ = ["GROUPS", "Judged", "Outcome", "Step", "judge", "main", "plan_steps", "run_steps"]

GROUPS = ("loopback", "rack-1gbit", "rack-n8-500mbit", "rack-10gbit", "loss", "ddp-1gbit",
          "ddp-500mbit")
_DDP_RATES = {"ddp-1gbit": "1gbit", "ddp-500mbit": "500mbit"}
_DDP_JSON = "ddp_steps.json"  # what bench.ddp_steps --out DIR writes in DIR


@dataclass(frozen=True)
class Step:
    """One benchmark process: `python -m reduction_appliance.bench.<module> <argv>`."""

    name: str  # where its JSON goes: DIR/<name>.json, or DIR/<name>/ddp_steps.json
    group: str  # the --only name, and what its verdicts read
    module: str
    argv: tuple[str, ...]

    def command(self) -> list[str]:
        return [sys.executable, "-m", f"reduction_appliance.bench.{self.module}", *self.argv]

    def shown(self) -> str:
        """The command as a reader would type it."""
        return " ".join(["python -m", f"reduction_appliance.bench.{self.module}", *self.argv])


@dataclass(frozen=True)
class Outcome:
    step: str
    returncode: int
    seconds: float


def plan_steps(out: Path, repeat: int, groups: Sequence[str] = GROUPS) -> list[Step]:
    """The steps of `groups`, each with its figures `repeat` times."""
    r = str(repeat)

    def allreduce(name: str, *argv: str) -> Step:
        return Step(name, name, "allreduce",
                    (*argv, "--repeat", r, "--json", str(out / f"{name}.json")))

    steps = {
        "loopback": [allreduce("loopback", "--network", "loopback")],
        "rack-1gbit": [allreduce("rack-1gbit", "--network", "rack", "--rate", "1gbit",
                                 "--sizes", "64MiB")],
        "rack-n8-500mbit": [allreduce("rack-n8-500mbit", "--network", "rack", "--workers", "8",
                                      "--rate", "500mbit", "--sizes", "1MiB,64MiB")],
        "rack-10gbit": [allreduce("rack-10gbit", "--network", "rack", "--rate", "10gbit",
                                  "--sizes", "4MiB,64MiB")],
        "loss": [Step("loss", "loss", "loss",
                      ("--repeat", r, "--json", str(out / "loss.json")))],
    }
    for group, rate in _DDP_RATES.items():
        steps[group] = [Step(f"{group}-{i}", group, "ddp_steps",
                             ("--workers", "4", "--rate", rate, "--steps", "300",
                              "--out", str(out / f"{group}-{i}")))
                        for i in range(1, repeat + 1)]
    return [step for group in groups for step in steps[group]]


Runner = Callable[[Step], int]


# How long a stopped step may take to tear its rack down (its daemon stops in 15 s at most).
_STEP_TEARDOWN_S = 60.0


def _run_process(step: Step) -> int:
    """The step's exit status. Stopped (Ctrl-C, or SIGTERM or SIGHUP: `Terminated`), the step
    gets the signal and time to tear its rack down: `subprocess.run` killed it 0.25 s after
    Ctrl-C, with its namespaces and daemon still up."""
    with subprocess.Popen(step.command()) as child:
        try:
            return child.wait()
        except KeyboardInterrupt as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                if signum == signal.SIGINT:  # a terminal's Ctrl-C reached the step as well
                    child.wait(timeout=1.0)
            if child.poll() is None:
                child.send_signal(signum)
            try:
                child.wait(timeout=_STEP_TEARDOWN_S)
            except subprocess.TimeoutExpired:
                child.kill()
            raise


def run_steps(out: Path, steps: Sequence[Step], runner: Runner = _run_process) -> list[Outcome]:
    """Each step in turn, whatever the one before did. A step's JSON from an earlier run in
    `out` goes first: a step that fails now must not be judged by what another run wrote."""
    outcomes: list[Outcome] = []
    started = time.monotonic()
    for step in steps:
        _json_of(out, step).unlink(missing_ok=True)
    for i, step in enumerate(steps, 1):
        elapsed = format_duration(time.monotonic() - started)
        print(f"\n### [{i}/{len(steps)}] {step.name} (elapsed {elapsed}): {step.shown()}",
              flush=True)
        t0 = time.monotonic()
        code = runner(step)
        outcomes.append(Outcome(step.name, code, time.monotonic() - t0))
        if code:
            print(f"### {step.name} exited with status {code}", flush=True)
    return outcomes


def _json_of(out: Path, step: Step) -> Path:
    return out / step.name / _DDP_JSON if step.module == "ddp_steps" else out / f"{step.name}.json"


@dataclass(frozen=True)
class Judged:
    """What the steps' JSON says."""

    verdicts: list[Verdict]
    problems: list[str]  # every result not exact, every step that wrote nothing
    gauges: list[float]  # the `bench.gauge` readings the steps took
    costs: str  # where the CPU goes per byte, a Markdown table


def judge(out: Path, steps: Sequence[Step], outcomes: Sequence[Outcome] = ()) -> Judged:
    """Read what the steps wrote under `out`."""
    codes = {o.step: o.returncode for o in outcomes}
    written: dict[str, Any] = {}
    ddp: dict[str, list[Any]] = {}
    missing: dict[str, str] = {}
    problems: list[str] = []
    gauges: list[float] = []
    for step in steps:
        path = _json_of(out, step)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            code = codes.get(step.name)
            why = (f"{step.name} exited with status {code}" if code else
                   f"{path} unreadable ({exc.__class__.__name__})")
            missing.setdefault(step.group, why)
            problems.append(f"{step.name}: no figures: {why}")
            continue
        if step.module == "ddp_steps":
            ddp.setdefault(step.group, []).append(data)
        else:
            written[step.group] = data
        gauges += _readings(data.get("gauge_ms"))
    problems += exactness(written, ddp)
    return Judged(all_verdicts(written, ddp, missing), problems, gauges, cost_table(written))


def _readings(value: Any) -> list[float]:
    """bench.gauge figures, however a benchmark nested them (one pair per run, or one pair)."""
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, list):
        return [x for item in value for x in _readings(item)]
    return []


def _report(out: Path, steps: Sequence[Step], outcomes: Sequence[Outcome]) -> int:
    judged = judge(out, steps, outcomes)
    verdicts, problems, gauges = judged.verdicts, judged.problems, judged.gauges
    measured = [v for v in verdicts if v.met is not None]
    print(f"\n## The targets ({sum(bool(v.met) for v in measured)} of {len(verdicts)} met; "
          f"{len(verdicts) - len(measured)} not measured)\n")
    print(markdown_table(verdicts))
    print("\nWhere the CPU goes per byte (medians of the runs; CPU seconds per GB allreduced, "
          "per rank's GB):\n")
    print(judged.costs)
    print("\nsteps:\n" + "\n".join(f"- {s.name}: `{s.shown()}`" for s in steps))
    if gauges:
        print(f"this machine's Python over the steps (bench.gauge, lower is faster): "
              f"{min(gauges):.1f}-{max(gauges):.1f} ms")
    print("every result exact" if not problems else
          "NOT every result exact or measured:\n  " + "\n  ".join(problems))
    summary = {"verdicts": [{**asdict(v), "unit": v.unit.value, "rule": v.rule.value,
                             "met": v.met} for v in verdicts],
               "problems": problems, "gauge_ms": gauges, "costs": judged.costs,
               "steps": [{**asdict(s), "command": s.shown()} for s in steps],
               "outcomes": [asdict(o) for o in outcomes]}
    (out / "targets.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / 'targets.json'}")
    try:
        from .targets_plot import plot_verdicts
    except ImportError:
        print("no plot: matplotlib (the plot extra) is not installed")
    else:
        print(f"wrote {plot_verdicts(out / 'targets.png', verdicts)}")
    return 1 if problems or any(o.returncode for o in outcomes) else 0


def _groups(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in GROUPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown steps {unknown or [text]}; choose from {', '.join(GROUPS)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reduction_appliance.bench.targets",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="runs of each case (default 3)")
    p.add_argument("--only", type=_groups, default=list(GROUPS), metavar="STEP,...",
                   help=f"run only these: {', '.join(GROUPS)}")
    p.add_argument("--out", type=Path, default=None,
                   help="where the JSON goes (default results/targets-<UTC time>)")
    p.add_argument("--report", type=Path, default=None, metavar="DIR",
                   help="run nothing: judge what an earlier run wrote in DIR")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if args.report is not None:
        if args.out is not None:
            p.error("--report judges DIR as it is; --out has no meaning with it")
        if not args.report.is_dir():
            p.error(f"--report {args.report}: no such directory")
        saved = _saved_run(args.report)
        if saved is None:
            p.error(f"--report {args.report}: no targets.json of an earlier run in it")
        return _report(args.report, *saved)
    if os.geteuid() != 0:
        print("bench.targets needs root: its racks are network namespaces", file=sys.stderr)
        return 1
    out = args.out or Path("results") / f"targets-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    steps = plan_steps(out, args.repeat, args.only)
    # Written first, so that --report can judge a run that was stopped half-way.
    (out / "targets.json").write_text(json.dumps(
        {"steps": [asdict(s) for s in steps]}, indent=2) + "\n")
    try:
        with unwinding_on_termination():  # SIGTERM and SIGHUP stop the running step first
            outcomes = run_steps(out, steps)
    except KeyboardInterrupt as exc:
        print(f"\nstopped; what ran can be judged with --report {out}", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    return _report(out, steps, outcomes)


def _saved_run(out: Path) -> tuple[list[Step], list[Outcome]] | None:
    """The steps an earlier run planned in `out`, and how those that ran ended (none if it was
    stopped before its report)."""
    try:
        saved = json.loads((out / "targets.json").read_text())
        steps = [Step(s["name"], s["group"], s["module"], tuple(s["argv"]))
                 for s in saved["steps"]]
        outcomes = [Outcome(o["step"], int(o["returncode"]), float(o["seconds"]))
                    for o in saved.get("outcomes", [])]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return steps, outcomes

if __name__ == "__main__":
    sys.exit(main())
