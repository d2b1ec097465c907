"""How long a big job's ranks take to join when they start together, and to leave when they end.

    python -m reduction_appliance.bench.joins [--ranks 256,1024,4096] [--cores 2]
                                              [--clients 4]

A launcher starts every rank of a job at once, and each joins the appliance (POST
/v1/jobs/ID/join) before its first round: the last join decides when the job can start. At
its end every rank leaves (POST .../leave) as its process exits. For each job size this starts
a real reductiond on loopback with `--cores` data-plane cores, registers the job, and lets
`--clients` processes join all its ranks at the same moment (a thread per rank; a process
holds a share of the ranks, as a host holds its GPUs), then leave them all at once. For each
phase it reports the time until the last answer, calls a second, each call's wait (median and
longest), the CPU per call of the daemon (its API and its cores, from /proc) and of the
clients, the calls that failed (a join gives up after 30 s, a leave after 10), and the
attempts given up (an attempt waits half its call's time, 15 s for a join and 5 for a leave:
each one given up queues again at the back, and the API skips the request it left behind,
`reduction_api_requests_abandoned_total`); it checks
that the job listed every rank as joined, and that the last leave ended it.

The ranks' endpoints are addresses on loopback nobody listens on: a join needs none, and the
job never reduces. Clients on the same few cores as the appliance take CPU from it (at 4096
ranks, thousands of client threads take more than the daemon): the daemon's CPU per call is
the figure that carries to a rack, the wall time an upper bound.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier, Event
from typing import NamedTuple

from reduction_appliance.control.apiclient import ApiError, UnixApi
from reduction_appliance.deploy.testnet.harness import local_daemon
from reduction_appliance.plugin.rendezvous import JobInfo, join, leave, register

from .cputime import tree_cpu_s
from .jobsizes import each_size, job_sizes, loopback_daemon
from .progress import ProgressBar

__all__ = ["JobLife", "Phase", "main", "measure"]

_FIRST_PORT = 10000  # rank r joins from 127.0.0.1:(10000 + r)
_ANSWER_S = 90.0


class Phase(NamedTuple):
    """Every rank joining, or every rank leaving."""
    seconds: float  # from the moment every client starts until the last answer
    waits: list[float]  # each call's, seconds
    daemon_cpu_s: float
    clients_cpu_s: float  # the calling processes', all of them (here, on the same cores)
    failed: list[str]  # what went wrong, one line per rank whose call failed
    given_up: int  # attempts whose client closed before the API's turn came (not served)

    def per_call_ms(self, ranks: int) -> tuple[float, float]:
        """CPU per call: the daemon's, the clients'."""
        return self.daemon_cpu_s / ranks * 1e3, self.clients_cpu_s / ranks * 1e3


class JobLife(NamedTuple):
    ranks: int
    joins: Phase
    leaves: Phase
    failed: list[str]  # the job's state after each phase, where it was not as it should be


def _client(info: JobInfo, ranks: list[int], ready: Barrier, go: Event, done: Event,
            answers: Queue[tuple[int, float, str]]) -> None:
    """One client process: a thread per rank, all joining once `go` is set (after every
    client's threads are up: `ready`), and leaving once `done` is set; each answers twice."""
    def timed(rank: int, call: Callable[[], object]) -> None:
        began = time.monotonic()
        try:
            call()
            failure = ""
        except Exception as exc:  # reported, rank by rank, by the bench
            failure = f"{type(exc).__name__}: {exc}"
        answers.put((rank, time.monotonic() - began, failure))

    # The rank threads wait on events of this process: a thousand threads waiting on one
    # event shared between processes wake one after another, over seconds.
    go_here, done_here = threading.Event(), threading.Event()

    def one(rank: int) -> None:
        go_here.wait()
        timed(rank, lambda: join(info, rank, ("127.0.0.1", _FIRST_PORT + rank)))
        done_here.wait()
        timed(rank, lambda: leave(info, rank))

    threads = [threading.Thread(target=one, args=(rank,), daemon=True) for rank in ranks]
    for thread in threads:
        thread.start()
    ready.wait()
    go.wait()
    go_here.set()
    done.wait()
    done_here.set()
    for thread in threads:
        thread.join()


def measure(ranks: int, cores: int, clients: int, progress: ProgressBar) -> JobLife:
    """One job of `ranks` ranks joined by `clients` processes at once, then left at once."""
    # These ranks never heartbeat: at the default liveness timeout of 5 s, a job whose joins
    # take 10 s is evicted as abandoned before its last rank joined.
    cfg = loopback_daemon(cores, liveness_timeout_s=60.0)
    # Not fork: the parent has threads (the daemon's output readers), and a lock one of them
    # holds at the fork would stay held in the child for good.
    spawn = multiprocessing.get_context("spawn")
    with local_daemon(cfg) as daemon:
        info = register(daemon.api, "joins", world_size=ranks, secret="bench")
        ready, go, done = spawn.Barrier(clients + 1), spawn.Event(), spawn.Event()
        answers: Queue[tuple[int, float, str]] = spawn.Queue()
        procs = [spawn.Process(target=_client, args=(info, list(range(i, ranks, clients)),
                                                    ready, go, done, answers), daemon=True)
                 for i in range(clients)]
        for proc in procs:
            proc.start()
        progress.update(label=f"{ranks} ranks: starting {clients} clients")
        try:
            ready.wait(timeout=120)
        except threading.BrokenBarrierError:
            raise SystemExit("a client process did not start: exit codes "
                             f"{[proc.exitcode for proc in procs]}") from None
        api, job = UnixApi(daemon.unix_socket), f"/v1/jobs/{info.job_id}"
        watched = _Watched(daemon.process.pid, procs, answers, ranks, progress,
                           lambda: int(api.get("/v1/status")["api_requests_abandoned"]))
        joins = watched.phase("joining", go)
        failed = []
        try:
            listed = api.request("GET", job)
        except ApiError as exc:  # evicted, say: the daemon's log says why
            failed.append(f"the job is gone after the joins ({exc}); the daemon's log ends: "
                          f"{daemon.stderr.text()[-600:]}")
        else:
            # (more listed than answered: ranks whose client gave up, joined all the same)
            missing = ranks - len(joins.failed) - len(listed["joined"])
            if missing > 0:
                failed.append(f"{missing} rank(s) answered as joined are not in the job's list")
        leaves = watched.phase("leaving", done)
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():  # (its calls gave up long ago: see the failures)
                proc.terminate()
        with contextlib.suppress(ApiError):  # (gone: as it should be)
            left = api.request("GET", job)
            failed.append(f"the job is still there after every rank left: {left['state']}, "
                          f"{len(left['joined'])} rank(s) joined")
        return JobLife(ranks, joins, leaves, failed)


class _Watched(NamedTuple):
    daemon_pid: int
    procs: Sequence[multiprocessing.process.BaseProcess]
    answers: Queue[tuple[int, float, str]]
    ranks: int
    progress: ProgressBar
    abandoned: Callable[[], int]  # the API's count of requests not served: their client left

    def phase(self, what: str, start: Event) -> Phase:
        """Every rank's call, from `start` until the last answer."""
        self.progress.update(label=f"{self.ranks} ranks: {what}")
        cpu0, clients0 = tree_cpu_s(self.daemon_pid), _clients_cpu_s(self.procs)
        abandoned0 = self.abandoned()
        began = time.monotonic()
        start.set()
        waits, failed = [], []
        for done in range(self.ranks):
            try:  # (a call gives up after its own 30 s: none is still trying after this)
                rank, wait, failure = self.answers.get(timeout=_ANSWER_S)
            except queue.Empty:
                failed.append(f"{self.ranks - done} rank(s) never answered, not even with an "
                              f"error, in {_ANSWER_S:g} s (a client process died?)")
                break
            waits.append(wait)
            if failure:
                failed.append(f"rank {rank}: {failure}")
            if done % 256 == 255:
                self.progress.update(label=f"{self.ranks} ranks {what}: {done + 1} answered")
        seconds = time.monotonic() - began
        return Phase(seconds, waits, tree_cpu_s(self.daemon_pid) - cpu0,
                     _clients_cpu_s(self.procs) - clients0, failed,
                     self.abandoned() - abandoned0)


def _clients_cpu_s(procs: Sequence[multiprocessing.process.BaseProcess]) -> float:
    return sum(tree_cpu_s(proc.pid) for proc in procs if proc.pid is not None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reduction_appliance.bench.joins",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="256,1024,4096",
                        help="job sizes, comma-separated (default 256,1024,4096)")
    parser.add_argument("--cores", type=int, default=2, help="data-plane cores (default 2)")
    parser.add_argument("--clients", type=int, default=4,
                        help="processes joining the ranks between them (default 4)")
    args = parser.parse_args(argv)
    sizes = job_sizes(parser, args.ranks)
    if not 1 <= args.cores <= 64 or not 1 <= args.clients <= 64:
        parser.error("--cores and --clients are 1..64")
    results = each_size(sizes, lambda n, progress: measure(n, args.cores, args.clients,
                                                          progress))
    print(f"{'ranks':>6} {'':>6} {'all done in':>12} {'a second':>9} {'wait median':>12} "
          f"{'longest':>8} {'daemon CPU each':>16} {'clients CPU each':>17} {'failed':>7} "
          f"{'given up':>9}")
    for life in results:
        for what, phase in (("join", life.joins), ("leave", life.leaves)):
            waits = phase.waits or [float("nan")]
            daemon_ms, clients_ms = phase.per_call_ms(life.ranks)
            print(f"{life.ranks:>6} {what:>6} {phase.seconds:>10.2f} s "
                  f"{life.ranks / phase.seconds:>9.0f} {statistics.median(waits):>10.2f} s "
                  f"{max(waits):>6.2f} s {daemon_ms:>13.2f} ms {clients_ms:>14.2f} ms "
                  f"{len(phase.failed):>7} {phase.given_up:>9}")
    failed = [line for life in results
              for line in (*life.joins.failed, *life.leaves.failed, *life.failed)]
    for line in failed[:8]:
        print(f"FAILED {line}")
    if len(failed) > 8:
        print(f"... and {len(failed) - 8} more")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
