"""What a big job's heartbeats cost the appliance.

    python -m reduction_appliance.bench.heartbeats [--ranks 64,1024,4096] [--rate 2000]
                                                   [--seconds 10]

Every rank of a job heartbeats the job's first core ten times per liveness timeout (twice a
second at the default 5 s) and hears back the ranks silent past the timeout (LIVENESS). For each
job size this starts a real reductiond on loopback with one data-plane core, joins that many
ranks from as many sockets, sends `--rate` heartbeats a second among them for `--seconds`, and
reads the core's CPU time from /proc: per heartbeat, as a share of the core, and what the
ranks' own rate would cost. Before the ranks' silence was kept between answers
(dataplane.slotstate.TimedOutRanks), an answer walked every rank: 154 us per heartbeat at 1024
ranks, a saturated core at 4096, which its supervisor killed as stalled (the row then says so;
benchmarks-journal.md, "A job of a thousand ranks").

Joining is sequential through the API: several seconds per thousand ranks. Needs as many open
files as ranks (it raises its soft limit to the hard one).
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import socket
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple

from reduction_appliance.control.apiclient import UnixApi
from reduction_appliance.deploy.testnet.harness import local_daemon
from reduction_appliance.plugin.lease import heartbeat
from reduction_appliance.plugin.rendezvous import join, register

from .cputime import tree_cpu_s
from .jobsizes import each_size, job_sizes, loopback_daemon
from .progress import ProgressBar

__all__ = ["Cost", "main", "measure"]

_DEFAULT_TIMEOUT_S = 5.0  # the job's liveness timeout: heartbeats come 10 times in it


class Cost(NamedTuple):
    ranks: int
    heartbeats: int
    seconds: float
    core_cpu_s: float  # NaN where the core did not last the run
    restarted: str = ""  # why the supervisor restarted it meanwhile, if it did

    @property
    def per_heartbeat_us(self) -> float:
        return self.core_cpu_s / self.heartbeats * 1e6

    @property
    def share(self) -> float:
        """Of one core, at the measured rate."""
        return self.core_cpu_s / self.seconds

    @property
    def own_rate_share(self) -> float:
        """Of one core, at the rate the job's ranks heartbeat themselves."""
        return self.per_heartbeat_us * 1e-6 * self.ranks * 10 / _DEFAULT_TIMEOUT_S


def _core(api: UnixApi) -> tuple[int, int, str]:
    """The one core's pid, its restarts, and why it last exited."""
    core = api.request("GET", "/v1/status")["cores"][0]
    return int(core["pid"] or 0), int(core["restarts"]), str(core.get("last_exit") or "")


def measure(ranks: int, rate: float, seconds: float, progress: ProgressBar) -> Cost:
    """One job of `ranks` ranks, heartbeating at `rate` a second for `seconds`."""
    with local_daemon(loopback_daemon(1, _DEFAULT_TIMEOUT_S)) as daemon, \
            contextlib.ExitStack() as sockets:
        info = register(daemon.api, "heartbeats", world_size=ranks, secret="bench")
        beats: list[tuple[socket.socket, bytes]] = []
        for rank in range(ranks):
            sock = sockets.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
            joined = join(info, rank, sock.getsockname())
            beats.append((sock, heartbeat(joined, rank, 1, joined.epoch)))
            if rank % 256 == 255:
                progress.update(label=f"{ranks} ranks: {rank + 1} joined")
        api = UnixApi(daemon.unix_socket)
        pid, restarts, _ = _core(api)
        dest = (info.cores[0].host, info.cores[0].port)
        progress.update(label=f"{ranks} ranks: heartbeating for {seconds:g} s")
        cpu0, start, sent = tree_cpu_s(pid), time.monotonic(), 0
        while time.monotonic() - start < seconds:
            for sock, datagram in beats:
                sock.sendto(datagram, dest)
                sent += 1
                with contextlib.suppress(BlockingIOError):
                    while sock.recv(65536):  # the answers, so that no buffer fills
                        pass
                ahead = sent / rate - (time.monotonic() - start)
                if ahead > 0.005:  # paced in steps of 5 ms, not per datagram
                    time.sleep(ahead)
        elapsed = time.monotonic() - start
        cpu = tree_cpu_s(pid) - cpu0
        now_pid, now_restarts, last_exit = _core(api)
        if (now_pid, now_restarts) != (pid, restarts):  # its time went with it
            return Cost(ranks, sent, elapsed, float("nan"), f"restarted: {last_exit}")
        return Cost(ranks, sent, elapsed, cpu)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reduction_appliance.bench.heartbeats",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="64,1024,4096",
                        help="job sizes, comma-separated (default 64,1024,4096)")
    parser.add_argument("--rate", type=float, default=2000.0,
                        help="heartbeats a second, all ranks together (default 2000)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per job size")
    args = parser.parse_args(argv)
    sizes = job_sizes(parser, args.ranks)
    if args.rate <= 0 or args.seconds <= 0:
        parser.error("--rate and --seconds are positive")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and max(sizes) + 64 > hard:
        parser.error(f"{max(sizes)} ranks need as many open files; this shell allows {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    costs = each_size(sizes, lambda n, progress: measure(n, args.rate, args.seconds, progress))
    print(f"{'ranks':>6} {'heartbeats/s':>13} {'us each':>8} {'core busy':>10} "
          f"{'at the ranks own rate':>22}")
    for c in costs:
        own = c.ranks * 10 / _DEFAULT_TIMEOUT_S
        if c.restarted:
            print(f"{c.ranks:>6} {c.heartbeats / c.seconds:>13.0f}  the core was {c.restarted}")
            continue
        print(f"{c.ranks:>6} {c.heartbeats / c.seconds:>13.0f} {c.per_heartbeat_us:>8.0f} "
              f"{c.share:>10.0%} {c.own_rate_share:>11.0%} at {own:>5.0f}/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
