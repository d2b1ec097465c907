"""The appliance's CPU per byte over RoCE against UDP, side by side on one machine.

    python -m reduction_appliance.bench.roce [--size 16MiB] [--workers 3] [--rounds 4]
        [--segment 1MiB] [--repeat 3] [--multicast] [--json out.json]

One reductiond (its core on rxe1) serves, in turn, a UDP job and a RoCE job of `--workers`
worker processes (rxe2..), each allreducing `--size` of fp32 `--rounds` times (after one untimed
round); every result is checked. Per transport it reports the appliance core's CPU seconds
(user + system, from /proc) per GB reduced, the workers' CPU per GB, and for RoCE the core's
verbs calls per MiB each worker sent (posted sends and receives, and completion polls that
found work; empty polls, the idle loop's, are listed apart). The ratio of the two CPU figures
is the point: RoCE moves the bytes in the NIC (here: the rxe driver in the kernel, which is
not the core's CPU) and leaves Python one completion per segment. `--multicast` adds a third
job per run whose results go as UD multicast chunks (`roce-mc`), for what that mode costs.

Needs RDMA devices rxe1..rxe(workers + 1) on 10.77.0.1..: where there are none and we are
root, the benchmark runs itself inside the soft-RoCE guest (deploy/roce/guest.sh). Figures
from the guest are relative only (its CPU is emulated): never compare them with a host's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from reduction_appliance.dataplane.units import format_size
from reduction_appliance.dataplane.verbs import roce_unavailable

from .cputime import tree_cpu_s
from .plan import parse_sizes
from .progress import ProgressBar

__all__ = ["main"]

GUEST = Path(__file__).resolve().parents[1] / "deploy" / "roce" / "guest.sh"
START_S = 300.0
_JSON_MARK = "bench.roce json: "  # the guest emulates its CPU: a process start takes seconds there


# ---- a worker process ----------------------------------------------------------------------

def _worker(a: argparse.Namespace) -> int:
    from reduction_appliance.plugin.client import ApplianceClient
    from reduction_appliance.plugin.rendezvous import leave, register

    multicast = a.transport == "roce-mc"
    info = register(a.api, a.job, a.workers, secret="bench-" + a.job, multicast=multicast,
                    transport="roce" if multicast else a.transport)
    n = a.size // 4
    want = np.full(n, sum(range(1, a.workers + 1)), np.float32)
    with ApplianceClient([info], a.rank, local_address=a.ip) as client:
        x = np.full(n, a.rank + 1, np.float32)
        client.allreduce(x)  # untimed: connections, first-touch of every buffer
        print("ready", flush=True)
        sys.stdin.readline()  # "go": every rank starts together
        cpu0, t0 = time.process_time(), time.monotonic()
        bad = 0
        for _ in range(a.rounds):
            x[:] = a.rank + 1
            client.allreduce(x)
            bad += not np.array_equal(x, want)
        report = {"wall_s": time.monotonic() - t0, "cpu_s": time.process_time() - cpu0,
                  "bad": bad, "retransmissions": client.retransmissions}
        leave(client.jobs[0], a.rank)
    print(json.dumps(report), flush=True)
    return 0


# ---- the appliance ---------------------------------------------------------------------------

@contextlib.contextmanager
def _appliance(segment: int, workers: int) -> Iterator[tuple[str, str]]:
    from reduction_appliance.deploy.testnet.harness import local_daemon

    with local_daemon({
        "dataplane": {"address": "10.77.0.1", "kernels": "numpy",
                      "slot_memory_mb": max(64, 6 * segment * 8 >> 20), "rx_buffers": 256,
                      "core_start_timeout_s": START_S, "core_reply_timeout_s": 60.0},
        "multicast": {"groups": "239.255.77.0/28"}, "jobs": {"slots": 8},
        "roce": {"device": "rxe1", "segment_bytes": segment, "queue_pairs": 4 * workers},
        "api": {"listen": "10.77.0.1:0"},
    }, ready_s=START_S) as daemon:
        yield daemon.api, daemon.unix_socket


def _status(sock: str) -> dict[str, Any]:
    from reduction_appliance.control.apiclient import UnixApi

    answer: dict[str, Any] = UnixApi(sock).request("GET", "/v1/status")
    return answer


def _one(api: str, sock: str, transport: str, a: argparse.Namespace, run: int) -> dict[str, Any]:
    """One transport's measurement: workers ready, counters and CPU read, go, wait, read."""
    job = f"bench-{transport}-{run}"
    workers = [subprocess.Popen(
        [sys.executable, "-m", "reduction_appliance.bench.roce", "--worker", "--api", api,
         "--job", job, "--rank", str(r), "--workers", str(a.workers), "--ip",
         f"10.77.0.{2 + r}", "--size", str(a.size), "--rounds", str(a.rounds),
         "--transport", transport],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(a.workers)]
    try:
        for w in workers:
            assert w.stdout is not None
            line = w.stdout.readline()
            if line.strip() != "ready":
                raise SystemExit(f"bench.roce: a {transport} worker failed: "
                                 f"{w.stderr.read()[-2000:] if w.stderr else ''}")
        before = _status(sock)["cores"][0]
        core_cpu0 = tree_cpu_s(before["pid"])
        for w in workers:
            assert w.stdin is not None
            w.stdin.write("go\n")
            w.stdin.flush()
        reports = []
        for w in workers:
            out, err = w.communicate(timeout=START_S * 4)
            if w.returncode != 0:
                raise SystemExit(f"bench.roce: a {transport} worker failed: {err[-2000:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
        core_cpu = tree_cpu_s(before["pid"]) - core_cpu0
        after = _status(sock)["cores"][0]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    delta = {k: after["counters"][k] - before["counters"][k] for k in after["counters"]}
    reduced = delta["bytes_reduced"]
    mib_per_worker = a.size * a.rounds / 2**20
    busy_polls = delta["roce_completions"] and min(delta["roce_polls"],
                                                   delta["roce_completions"])
    return {
        "transport": transport, "bytes_reduced": reduced,
        "core_cpu_s": core_cpu, "core_cpu_s_per_gb": core_cpu / (reduced / 1e9),
        "worker_cpu_s_per_gb": sum(r["cpu_s"] for r in reports) / (reduced / 1e9),
        "wall_s": max(r["wall_s"] for r in reports),
        "bad_results": sum(r["bad"] for r in reports),
        "retransmissions": sum(r["retransmissions"] for r in reports),
        "segments_in": delta["packets_in"],
        "result_writes": delta.get("roce_result_writes", 0),
        "multicast_chunks": delta.get("roce_multicast_chunks", 0),
        "verbs_calls_per_mib": (delta["roce_post_send"] + delta["roce_post_recv"] + busy_polls)
        / (a.workers * mib_per_worker),
        "empty_polls_per_mib": (delta["roce_polls"] - busy_polls) / (a.workers * mib_per_worker),
    }


def _print(row: dict[str, Any]) -> None:
    verbs = (f", verbs calls {row['verbs_calls_per_mib']:.1f}/MiB per worker "
             f"(+{row['empty_polls_per_mib']:.0f} empty polls), {row['result_writes']} results "
             f"RDMA-written, {row['multicast_chunks']} multicast chunks"
             if row["transport"] != "udp" else "")
    print(f"  {row['transport']:>7}: appliance core {row['core_cpu_s_per_gb']:7.2f} CPU s/GB, "
          f"workers {row['worker_cpu_s_per_gb']:7.2f} CPU s/GB, {row['segments_in']} "
          f"segments in, {row['wall_s']:.1f} s, {row['retransmissions']} retransmissions"
          f"{verbs}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reduction_appliance.bench.roce",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="16MiB", help="bytes each worker allreduces per round")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--segment", default="1MiB", help="RoCE message size (config roce.segment)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--multicast", action="store_true",
                   help="also a RoCE job with UD multicast results (roce-mc)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--json-line", action="store_true", help=argparse.SUPPRESS)
    # internal: one worker process
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--api", "--job", "--ip", "--transport"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.size = parse_sizes(a.size)[0] if isinstance(a.size, str) else a.size
    if a.worker:
        return _worker(a)
    segment = parse_sizes(a.segment)[0]
    if not 1 <= a.workers <= 3 or a.rounds < 1 or a.repeat < 1:
        p.error("--workers 1..3 (rxe2..rxe4), --rounds and --repeat >= 1")
    missing = next((why for d in range(1, a.workers + 2)
                    if (why := roce_unavailable(f"rxe{d}")) is not None), None)
    if missing is not None:
        if os.environ.get("ROCE_GUEST") or os.geteuid() != 0:
            print(f"bench.roce: {missing}; run it as root (it starts the soft-RoCE guest) or "
                  f"inside it: bash {GUEST} run --rxe 4 -- {sys.executable} -m "
                  "reduction_appliance.bench.roce", file=sys.stderr)
            return 1
        print(f"bench.roce: {missing}: running inside the soft-RoCE guest ({GUEST})", flush=True)
        # The guest runs us without --json and prints the report as one marked line, which
        # this side writes where asked (the guest's writable directory is only the current
        # one, and mounting another over its /tmp would break the daemon's Unix socket).
        args = list(argv if argv is not None else sys.argv[1:])
        where = args.index("--json") if "--json" in args else -1
        args = args[:where] + args[where + 2:] if where >= 0 else [
            x for x in args if not x.startswith("--json=")]
        cmd = ["bash", str(GUEST), "run", "--rxe", "4", "--timeout", "3600", "--",
               sys.executable, "-m", "reduction_appliance.bench.roce", *args, "--json-line"]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as guest:
            assert guest.stdout is not None
            for line in guest.stdout:
                if line.startswith(_JSON_MARK):
                    if a.json is not None:
                        a.json.write_text(line[len(_JSON_MARK):])
                    continue
                print(line, end="", flush=True)
        return guest.returncode
    print(f"bench.roce: {a.workers} workers x {format_size(a.size)} fp32 x {a.rounds} rounds, "
          f"RoCE segments of {format_size(segment)}, {a.repeat} runs; relative figures only "
          "where the CPU is emulated", flush=True)
    runs: list[list[dict[str, Any]]] = []
    cases = ("udp", "roce", "roce-mc") if a.multicast else ("udp", "roce")
    progress = ProgressBar(len(cases) * a.repeat)
    with _appliance(segment, a.workers) as (api, sock):
        for run in range(a.repeat):
            rows = []
            for transport in cases:
                progress.update(label=f"run {run + 1} {transport}")
                rows.append(_one(api, sock, transport, a, run))
                progress.advance()
            runs.append(rows)
    progress.close()
    ratios, multicast_ratios = [], []
    for i, rows in enumerate(runs):
        udp, roce = rows[0], rows[1]
        print(f"run {i + 1}:")
        for row in rows:
            _print(row)
        ratio = roce["core_cpu_s_per_gb"] / udp["core_cpu_s_per_gb"]
        ratios.append(ratio)
        print(f"  appliance CPU per GB, RoCE / UDP: {ratio:.3f} (1/{1 / ratio:.1f})")
        if len(rows) > 2:
            multicast_ratios.append(rows[2]["core_cpu_s_per_gb"] / udp["core_cpu_s_per_gb"])
            print(f"  appliance CPU per GB, RoCE multicast / UDP: {multicast_ratios[-1]:.3f}")
    bad = sum(r["bad_results"] for rows in runs for r in rows)
    verbs = [rows[1]["verbs_calls_per_mib"] for rows in runs]
    print(f"median appliance CPU per GB RoCE / UDP: {statistics.median(ratios):.3f} "
          f"(runs {', '.join(f'{r:.3f}' for r in ratios)}; target <= 0.2); "
          f"verbs calls per MiB per worker: median {statistics.median(verbs):.1f} "
          f"(runs {', '.join(f'{v:.1f}' for v in verbs)}; target <= 8); "
          f"{'every result exact' if not bad else f'{bad} WRONG RESULTS'}")
    if multicast_ratios:
        print(f"median appliance CPU per GB RoCE multicast / UDP: "
              f"{statistics.median(multicast_ratios):.3f} "
              f"(runs {', '.join(f'{r:.3f}' for r in multicast_ratios)})")
    report = json.dumps({"runs": runs, "ratios": ratios, "multicast_ratios": multicast_ratios})
    if a.json is not None:
        a.json.write_text(report)
    if a.json_line:
        print(_JSON_MARK + report, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
