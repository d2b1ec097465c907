"""DDP training step time: Gloo ring against the appliance, side by side on one emulated rack.

    python -m reduction_appliance.bench.ddp_steps --workers 4 --rate 1gbit --steps 300 \\
        [--out results/ddp]

Builds ONE rack (worker links shaped to --rate, the appliance's link unshaped), then runs
examples/train_ddp.py on every worker three times with the same model, data and seed:
``--comm gloo`` (DDP on Gloo's ring) while no appliance runs, so Gloo has every CPU, then
``reduction`` (the torch.distributed backend) and ``hook`` (Gloo default group plus the
appliance DDP comm hook) against one ``reductiond``.

A step is zero_grad + forward + backward (which returns once DDP has every bucket averaged) +
optimizer step. A step's time is its slowest rank's; a run's figure is the median (and mean)
over the steps after the warm-up. Speedup = Gloo's median / the run's median. Each run also
checks that every rank ends with bit-identical parameters, and reports the held-out loss, which
must agree across the three runs up to fp32 summation order (the appliance adds in a different
order than the ring).

With ``--ranks-per-host k``, k ranks share each host and its link (a server with k GPUs and
one NIC): the backend and the hook reduce on the host first and one rank per host talks to
the appliance (`plugin.torch_hosts`), while Gloo's ring passes between a host's ranks over
loopback.

With ``--compress bf16`` (or ``fp16``) every run sends its buckets in that dtype, half the
bytes: Gloo and the backend through torch's ``bf16_compress_hook``, the hook through its own
``compress=`` (`plugin.torch_hook`).

Prints a table; with --out writes ddp_steps.json (plan, environment, one row per run).
Exits 1 if a run failed or its ranks disagree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from reduction_appliance.deploy.testnet.harness import (
    ApplianceProcess,
    HarnessError,
    LabNetwork,
    Network,
    run_workers,
    start_appliance,
)
from reduction_appliance.deploy.testnet.topology import parse_rate

from .cputime import CpuSample
from .gauge import framing, interpreter_ms
from .plan import unwritable_output
from .progress import ProgressBar

__all__ = ["COMMS", "EXAMPLE", "CommRun", "Plan", "example_argv", "main", "run_comm", "run_plan"]

# The repository's example (a checkout's examples/ folder: the benchmark runs from a checkout).
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
COMMS = ("gloo", "reduction", "hook")
# A fresh rendezvous port per run: the previous run's listening socket may sit in TIME_WAIT.
_STORE_BASE_PORT = 29400
_RUN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Plan:
    workers: int
    rate: str | None  # worker link rate, tc syntax; None = unshaped veth
    steps: int
    warmup: int
    batch: int
    hidden: int
    layers: int
    bucket_mb: float
    seed: int
    cores: int  # appliance data-plane cores
    lanes: int | None  # appliance rounds in flight; None = the plugin's default
    device: str = "cpu"  # where each rank's model lives (cuda: every rank on a GPU)
    ranks_per_host: int = 1  # ranks behind one host's link (a server with several GPUs)
    compress: str = "none"  # the dtype every run's buckets travel in (the example's --compress)

    def options(self) -> list[str]:
        """The example's flags that every rank of every run shares."""
        return ["--steps", str(self.steps), "--warmup", str(self.warmup), "--batch",
                str(self.batch), "--hidden", str(self.hidden), "--layers", str(self.layers),
                "--bucket-mb", str(self.bucket_mb), "--seed", str(self.seed), "--json",
                *(["--compress", self.compress] if self.compress != "none" else []),
                *(["--lanes", str(self.lanes)] if self.lanes else []), "--device", self.device]


@dataclass(frozen=True)
class CommRun:
    """One training run's per-rank JSON reports (examples/train_ddp.py --json)."""

    comm: str
    ranks: list[dict[str, Any]]
    # The appliance's counters over the run, summed over its cores (None: no appliance up).
    counters: dict[str, int] | None = None
    # CPU over the whole run (rank start-up included): the appliance's (its daemon and data
    # plane; None: no appliance up), and the machine's busy fraction of every CPU.
    appliance_cpu_s: float | None = None
    machine_busy: float = 0.0

    @property
    def step_ms(self) -> list[float]:
        """Per step, the slowest rank's time."""
        return [max(steps) for steps in zip(*(r["step_ms"] for r in self.ranks), strict=True)]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.step_ms)

    @property
    def ranks_agree(self) -> bool:
        """Bit-identical parameters on every rank: every rank applied the same averages."""
        return len({r["params_sha256"] for r in self.ranks}) == 1

    @property
    def appliance_cpu_ms_per_step(self) -> float | None:
        """The appliance's CPU per training step (its idle polling included, which is small)."""
        if self.appliance_cpu_s is None:
            return None
        return self.appliance_cpu_s * 1e3 / int(self.ranks[0]["steps"])

    @property
    def eval_loss(self) -> float:
        return float(self.ranks[0]["eval_loss"])

    def row(self, gloo: CommRun | None) -> dict[str, Any]:
        first = self.ranks[0]
        return {
            "comm": self.comm, "step_ms_median": self.median_ms, "step_ms_mean": self.mean_ms,
            "speedup": gloo.median_ms / self.median_ms if gloo else None,
            "first_loss": first["first_loss"], "final_loss": first["final_loss"],
            "eval_loss": self.eval_loss, "eval_accuracy": first["eval_accuracy"],
            "ranks_agree": self.ranks_agree, "params_sha256": first["params_sha256"],
            "grad_bytes": first["grad_bytes"], "bucket_bytes": first["bucket_bytes"],
            "appliance_counters": self.counters,
            "appliance_cpu_ms_per_step": self.appliance_cpu_ms_per_step,
            "machine_busy": self.machine_busy, "loss_curve": first["loss_curve"],
            "step_ms": self.step_ms,
        }


def example_argv(net: Network, comm: str, rank: int, world: int, store: str,
                 appliance: str | None, options: Sequence[str]) -> list[str]:
    """One rank's command line (after `python`). `store` is the c10d rendezvous host:port."""
    return [str(EXAMPLE), "--comm", comm, "--rank", str(rank), "--world", str(world),
            "--init-method", f"tcp://{store}", "--local-address", net.worker_address(rank),
            *(["--appliance", appliance] if appliance else []), *options]


def run_comm(net: Network, comm: str, world: int, index: int, options: Sequence[str],
             appliance: ApplianceProcess | None = None,
             timeout_s: float = _RUN_TIMEOUT_S) -> CommRun:
    """Train once with `comm` on ranks 0..world-1; `index` picks the rendezvous port. The c10d
    store listens on worker 0's address: every worker namespace reaches it over the bridge.
    With an `appliance`, its counters over the run come along (even for Gloo, which must leave
    them alone)."""
    if comm != "gloo" and appliance is None:
        raise ValueError(f"--comm {comm} needs an appliance")
    store = f"{net.worker_address(0)}:{_STORE_BASE_PORT + index}"
    api = appliance.api if appliance else None
    argv = [example_argv(net, comm, rank, world, store, api, options) for rank in range(world)]
    before = appliance.counters() if appliance else {}
    appliance_pid = appliance.process.pid if appliance else None
    cpu_before, wall_before = CpuSample.take(appliance_pid), time.monotonic()
    outputs = run_workers(net, argv, timeout_s=timeout_s)
    cpu = CpuSample.take(appliance_pid).since(cpu_before)
    wall_s = time.monotonic() - wall_before
    counters = None
    if appliance is not None:
        # The workers have left the job: the appliance is idle, these are the run's totals.
        counters = {k: v - before.get(k, 0) for k, v in appliance.counters().items()}
    ranks = [out[-1] for out in outputs if out]
    if len(ranks) != world:
        raise HarnessError(f"{comm}: {world - len(ranks)} ranks printed no report")
    return CommRun(comm, ranks, counters,
                   appliance_cpu_s=cpu.tree_s if appliance else None,
                   machine_busy=cpu.machine_s / (wall_s * (os.cpu_count() or 1)))


@contextlib.contextmanager
def _rack(plan: Plan) -> Iterator[Network]:
    with LabNetwork.rack(plan.workers, rate=plan.rate,
                         ranks_per_host=plan.ranks_per_host) as lab:
        # cast: harness.Network declares `mtu` as a plain attribute, LabNetwork has a property.
        yield cast(Network, lab)


def run_plan(plan: Plan, progress: ProgressBar | None = None) -> list[CommRun]:
    """Gloo with no appliance running, then the backend and the hook against one appliance."""
    runs: list[CommRun] = []

    def one(net: Network, comm: str, appliance: ApplianceProcess | None) -> None:
        if progress is not None:
            progress.update(label=f"n={plan.workers} {comm}")
        runs.append(run_comm(net, comm, plan.workers, len(runs), plan.options(), appliance))
        if progress is not None:
            progress.advance()

    with _rack(plan) as net:
        one(net, "gloo", None)
        with start_appliance(net, cores=plan.cores) as appliance:
            for comm in COMMS[1:]:
                one(net, comm, appliance)
    return runs


def rows(runs: list[CommRun]) -> list[dict[str, Any]]:
    gloo = next((r for r in runs if r.comm == "gloo"), None)
    return [r.row(gloo) for r in runs]


def format_table(plan: Plan, runs: list[CommRun]) -> str:
    first = runs[0].ranks[0]
    buckets = ", ".join(f"{b / 2**20:.2f}" for b in first["bucket_bytes"])
    where = "" if plan.device == "cpu" else f" (models on {first.get('device', plan.device)})"
    if plan.ranks_per_host > 1:
        where += (f" on {plan.workers // plan.ranks_per_host} hosts of {plan.ranks_per_host} "
                  "(the appliance's runs reduce on each host first)")
    if plan.compress != "none":
        where += (f", buckets sent as {plan.compress} (gloo and reduction: "
                  "compressed_allreduce_hook; hook: compress=)")
    lines = [
        f"DDP on {plan.workers} workers{where}, worker links {plan.rate or 'unshaped'}: MLP "
        f"{first['params']:,} params, gradient {first['grad_bytes'] / 2**20:.2f} MiB in buckets "
        f"of [{buckets}] MiB, batch {plan.batch}/rank, {plan.steps} steps "
        f"({plan.warmup} warm-up not timed); step = slowest rank's",
        "",
        f"{'comm':<10} {'median':>10} {'mean':>10} {'speedup':>8} {'final loss':>11} "
        f"{'held-out':>9} {'accuracy':>9} {'resent':>7} {'appl.CPU':>9} {'busy':>5}  ranks",
    ]
    for row in rows(runs):
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        counters = row["appliance_counters"]
        resent = "-" if counters is None else str(counters.get("results_resent", 0))
        cpu_ms = row["appliance_cpu_ms_per_step"]
        appliance_cpu = "-" if cpu_ms is None else f"{cpu_ms:.1f}ms"
        lines.append(
            f"{row['comm']:<10} {row['step_ms_median']:>8.1f}ms {row['step_ms_mean']:>8.1f}ms "
            f"{speedup:>8} {row['final_loss']:>11.4f} {row['eval_loss']:>9.4f} "
            f"{row['eval_accuracy']:>9.3f} {resent:>7} {appliance_cpu:>9} "
            f"{row['machine_busy']:>5.0%}  "
            f"{'identical' if row['ranks_agree'] else 'DIFFER'}")
    lines += ["", "final loss: rank 0's last training batch; held-out: the same 2048 samples on "
              "every rank.",
              "resent: results the appliance sent again because a worker timed out and "
              "retransmitted (a starved CPU shows up here first).",
              f"appl.CPU: the appliance's CPU per step; busy: the machine's {os.cpu_count()} "
              "CPUs, start-up included. Everything shares them here (an appliance has its own "
              "server),",
              "so the appliance's CPU is taken from the ranks'."]
    return "\n".join(lines)


def write_json(out: Path, plan: Plan, runs: list[CommRun],
               gauge_ms: tuple[float, float] | None = None) -> Path:
    """`gauge_ms`: `bench.gauge` before and after the run."""
    from .report import environment

    out.mkdir(parents=True, exist_ok=True)
    path = out / "ddp_steps.json"
    path.write_text(json.dumps({"plan": asdict(plan), "environment": environment(),
                                "rows": rows(runs), "gauge_ms": gauge_ms}, indent=2) + "\n")
    return path


def parse_args(argv: list[str] | None) -> tuple[Plan, Path | None]:
    p = argparse.ArgumentParser(prog="reduction_appliance.bench.ddp_steps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rate", default="1gbit",
                   help="worker link rate, tc syntax (default 1gbit); 'none' for unshaped")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the times")
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cores", type=int, default=1, help="appliance data-plane cores")
    p.add_argument("--lanes", type=int, default=None,
                   help="appliance rounds on the wire at once (default: the plugin's)")
    p.add_argument("--device", default="cpu",
                   help="the ranks' device: cpu, or cuda (rank r on GPU r modulo the GPUs: "
                        "the appliance's CUDA staging path; Gloo stages CUDA tensors too)")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks sharing each host's link (default 1; --workers must be a "
                        "multiple): the appliance's runs reduce on each host first")
    p.add_argument("--compress", choices=("none", "bf16", "fp16"), default="none",
                   help="send every run's buckets in this dtype (half the bytes), Gloo's "
                        "included (torch's compress hooks)")
    p.add_argument("--out", type=Path, default=None, help="directory for ddp_steps.json")
    args = p.parse_args(argv)
    if (unwritable := unwritable_output(args.out, directory=True)) is not None:
        p.error(unwritable)
    if args.device.split(":")[0] not in ("cpu", "cuda"):
        p.error(f"--device {args.device!r}: cpu or cuda")
    if args.device != "cpu":
        import torch  # (only here: the benchmark itself runs no torch)

        if not torch.cuda.is_available():
            p.error(f"--device {args.device}: this torch sees no GPU (torch {torch.__version__})")
    rate = None if args.rate.lower() == "none" else args.rate
    if rate is not None:
        try:
            parse_rate(rate)
        except ValueError as exc:
            p.error(str(exc))
    if (args.workers < 2 or args.steps <= args.warmup or args.cores < 1
            or (args.lanes is not None and args.lanes < 1)):
        p.error("--workers >= 2, --steps > --warmup, --cores >= 1 and --lanes >= 1, please")
    if args.ranks_per_host < 1 or args.workers % args.ranks_per_host:
        p.error(f"--ranks-per-host {args.ranks_per_host}: a whole divisor of --workers "
                f"{args.workers}, please")
    plan = Plan(workers=args.workers, rate=rate, steps=args.steps, warmup=args.warmup,
                batch=args.batch, hidden=args.hidden, layers=args.layers,
                bucket_mb=args.bucket_mb, seed=args.seed, cores=args.cores,
                lanes=args.lanes, device=args.device, ranks_per_host=args.ranks_per_host,
                compress=args.compress)
    return plan, args.out


def main(argv: list[str] | None = None) -> int:
    plan, out = parse_args(argv)
    if os.geteuid() != 0:
        print("bench.ddp_steps needs root: the rack is built from network namespaces",
              file=sys.stderr)
        return 1
    progress = ProgressBar(len(COMMS))
    before = interpreter_ms()
    try:
        runs = run_plan(plan, progress)
    except HarnessError as exc:
        progress.close()
        print(f"ddp_steps failed: {exc}", file=sys.stderr)
        return 1
    progress.close()
    gauge = (before, interpreter_ms())
    print(format_table(plan, runs))
    print(framing(*gauge))
    if out is not None:
        print(f"wrote {write_json(out, plan, runs, gauge)}")
    return 0 if all(r.ranks_agree for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
