"""Starts the data-plane processes, one per configured core, keeps them alive, and talks to them.

Each core gets a pipe (its mailbox) and a small shared-memory array (its counters, which only it
writes). Requests carry an id and the reply must carry it back (`dataplane.spec`): a reply that
arrives after its request gave up is recognised and dropped, so replies can never slip out of
step with requests. A core that does not answer within `dataplane.core_reply_timeout_s` is
stalled (stopped, wedged): it is killed, which the monitor sees as a death and restarts. A
monitor thread waits
on the processes: a core that dies is restarted with exponential backoff, gets every current
job again, and the event is recorded for the jobs that had traffic on it (status shows it);
`on_restart` then moves its jobs to a new epoch, since the new process starts with empty
slots (their workers carry on, or a round that had results fails with a clear error).
`Supervisor` is a context manager: leaving it stops every core and frees the memory. A core's
handle and its state machine are control.cores'.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from multiprocessing.shared_memory import SharedMemory
from types import TracebackType
from typing import Any, TypeVar, cast

import numpy as np

from reduction_appliance.dataplane.counters import N_COUNTERS, Counters
from reduction_appliance.dataplane.errors import (
    BadRequest,
    CoreFailure,
    ReductionError,
)
from reduction_appliance.dataplane.loop import run_core
from reduction_appliance.dataplane.reduce import KERNEL_MODULES
from reduction_appliance.dataplane.spec import (
    AbortJob,
    AcceptQueuePair,
    AddJob,
    Command,
    CoreConfig,
    CoreState,
    CoreStats,
    ErrorReport,
    FenceJobs,
    Fences,
    JobSpec,
    QueryStats,
    QueuePairs,
    Ready,
    ReleaseQueuePairs,
    RemoveJob,
    Reply,
    Request,
    RoceSettings,
    Stop,
    UpdateJob,
)

from .config import ApplianceConfig
from .cores import CoreEvent, CoreHandle, CoreUnavailable, Disruption
from .fallbacks import Fallbacks

__all__ = ["CoreHandle", "CoreUnavailable", "Disruption", "Supervisor"]

R = TypeVar("R")
_log = logging.getLogger("reductiond.supervisor")

_BACKOFF_FIRST_S = 0.2
_BACKOFF_MAX_S = 10.0
_STABLE_S = 30.0  # running this long resets the backoff
# What the cores' fork server imports before any fork (see Supervisor.__init__). pyverbs only
# loads libibverbs here; devices are opened by each core after its fork.
_CORE_MODULES = ["reduction_appliance.dataplane.loop"]
_ROCE_MODULES = ["reduction_appliance.dataplane.dual", "reduction_appliance.dataplane.roce",
                 "pyverbs.device", "pyverbs.pd", "pyverbs.mr", "pyverbs.cq", "pyverbs.srq",
                 "pyverbs.qp", "pyverbs.wr", "pyverbs.enums"]


class Supervisor:
    def __init__(self, cfg: ApplianceConfig,
                 on_restart: Callable[[int], None] | None = None,
                 fallbacks: Fallbacks | None = None) -> None:
        """`on_restart(core)` is called (from the monitor thread) after a core that died runs
        again with every job: its slots started empty, so the jobs need a new epoch."""
        self.cfg = cfg
        self.on_restart = on_restart
        self.cores: list[CoreHandle] = []
        self.jobs: dict[int, JobSpec] = {}  # what every running core has been told
        self.disruptions: dict[int, list[Disruption]] = {}  # job id -> core restarts it saw
        # Cores start as forks of a fork server (a fresh single-threaded interpreter, so the
        # daemon's API threads are never duplicated) that imported the data plane once. Spawned,
        # each core imported the daemon's whole __main__ again, the API included (35 s of
        # imports in the emulated RoCE guest), and torch once per core. On this 2-CPU host a
        # killed core now runs again in 0.49 s with numpy kernels, 0.57 s with torch's, 0.2 s
        # of it the first backoff (spawned: 1.0 and 2.4 s; once over the workers' 5 s liveness
        # timeout on a loaded CI host); with torch each core's own memory (PSS) is 88 MB, not
        # 192 MB, since the fork server's pages are shared.
        self._ctx = mp.get_context("forkserver")
        self._stopping = threading.Event()
        self._jobs_lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self._ids = itertools.count(1)
        self.errors = 0  # unexpected errors the monitor survived
        self.fallbacks = fallbacks or Fallbacks()  # what cores report giving up, logged once

    def core_configs(self) -> list[CoreConfig]:
        dp = self.cfg.dataplane
        mc = self.cfg.multicast
        roce = self.cfg.roce
        return [
            CoreConfig(
                index=i, cpu=dp.cpus[i] if dp.cpus else None,
                bind=(dp.address, dp.base_port + i), max_payload=self.cfg.arena_payload,
                slot_capacity=self.cfg.slot_capacity, rx_buffers=dp.rx_buffers, poll=dp.poll,
                spin_us=dp.spin_us, multicast_interface=mc.interface_address or dp.address,
                multicast_loop=mc.loop, tos=dp.dscp << 2,
                kernels=None if dp.kernels == "auto" else dp.kernels,
                roce=RoceSettings(roce.device, roce.port, roce.gid_index, roce.send_depth,
                                  roce.queue_pairs) if roce.enabled else None,
            )
            for i in range(dp.cores)
        ]

    def preloaded_modules(self) -> list[str]:
        """What the fork server imports for these cores: the data plane, pyverbs where RoCE is
        on, and the kernels' backend module where it may be chosen (torch: seconds and hundreds
        of MB per process, imported once and shared by every core's pages)."""
        kernels = self.cfg.dataplane.kernels
        backends = [module for backend, module in KERNEL_MODULES.items()
                    if kernels in ("auto", backend)]
        return _CORE_MODULES + (_ROCE_MODULES if self.cfg.roce.enabled else []) + backends

    # ---- lifecycle ----
    def start(self) -> None:
        # (Only the first Supervisor of a process sets what its fork server imports; a module
        # not preloaded is imported by the core after the fork, as before.)
        self._ctx.set_forkserver_preload(self.preloaded_modules())
        for core_cfg in self.core_configs():
            memory = SharedMemory(create=True, size=N_COUNTERS * 8)
            cells: np.ndarray[Any, np.dtype[np.uint64]] = np.ndarray(
                (N_COUNTERS,), np.uint64, buffer=memory.buf)
            cells[:] = 0
            self.cores.append(CoreHandle(core_cfg, memory, Counters(cells)))
        for core in self.cores:
            self._spawn(core)
        for core in self.cores:
            self._await_ready(core)
        self._monitor = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._monitor.start()

    def _spawn(self, core: CoreHandle) -> None:
        ours, theirs = self._ctx.Pipe()
        process = self._ctx.Process(target=run_core, args=(core.config, theirs, core.memory.name),
                                    name=f"reductiond-core{core.config.index}", daemon=True)
        process.start()
        theirs.close()
        core.process, core.mailbox = process, ours

    def _await_ready(self, core: CoreHandle) -> None:
        """Wait for the core's Ready; raise what it reported instead (a bad kernel backend is
        the operator's `ConfigError`), or that it never answered."""
        assert core.mailbox is not None
        index = core.config.index
        # A core imports its kernels' backend (maybe torch) before it answers; the first start
        # also waits for the fork server's own imports.
        start_s = self.cfg.dataplane.core_start_timeout_s
        if not core.mailbox.poll(start_s):
            raise CoreFailure(f"data-plane core {index} did not start within {start_s:g} s "
                              "(dataplane.core_start_timeout_s)")
        try:
            first = core.mailbox.recv()
        except (EOFError, OSError) as exc:
            raise CoreFailure(f"data-plane core {index} died while starting") from exc
        if isinstance(first, ErrorReport):
            raise first.exception(index)
        if not isinstance(first, Ready):
            raise CoreFailure(f"data-plane core {index} sent {first!r} instead of Ready")
        core.kernels = first.kernels
        for what in first.fallbacks:
            self.fallbacks.note(what, index)
        core.move(CoreEvent.READY)
        core.started_at = time.monotonic()

    def _watch(self) -> None:
        """Restart cores that die, with backoff, until stop(). Nothing may end this thread:
        an unexpected error is logged and the watch goes on."""
        failures = [0] * len(self.cores)
        while not self._stopping.is_set():
            try:
                self._watch_once(failures)
            except Exception:
                _log.exception("supervisor: the core monitor failed; it goes on")
                self.errors += 1
                self._stopping.wait(1.0)

    def _watch_once(self, failures: list[int]) -> None:
        sentinels = {c.process.sentinel: c for c in self.cores
                     if c.process is not None and c.state is CoreState.RUNNING}
        for ready in wait(list(sentinels), timeout=0.5):
            if self._stopping.is_set():
                return
            core = sentinels[cast(int, ready)]
            assert core.process is not None
            core.process.join(timeout=1)  # reap it: exitcode is None until then
            code = core.process.exitcode
            why = (f"exit code {code}" if code is None or code >= 0
                   else f"killed by signal {-code}")
            core.last_exit = f"{core.stalled} ({why})" if core.stalled else why
            core.stalled = ""
            self._restart(core, failures)

    def _restart(self, core: CoreHandle, failures: list[int]) -> None:
        i = core.config.index
        if time.monotonic() - core.started_at > _STABLE_S:
            failures[i] = 0
        with core.lock:
            core.move(CoreEvent.DIED)
            core.restarts += 1
            with self._jobs_lock:
                for job_id in self.jobs:
                    self.disruptions.setdefault(job_id, []).append(
                        Disruption(i, time.time(), f"core {i} {core.last_exit}; restarted"))
        while core.state is CoreState.RESTARTING:
            delay = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** failures[i])
            failures[i] += 1
            if self._stopping.wait(delay):
                return
            with core.lock:
                if core.mailbox is not None:
                    core.mailbox.close()
                    core.mailbox = None
                started = False
                try:
                    self._spawn(core)
                    self._await_ready(core)
                    started = True
                    with self._jobs_lock:
                        specs = list(self.jobs.values())
                    for spec in specs:
                        self._exchange(core, AddJob(spec))
                except (ReductionError, OSError) as exc:
                    core.last_exit = f"restart failed: {exc}"
                    core.move(CoreEvent.DIED if started else CoreEvent.FAILED)
                    if core.process is not None:
                        core.process.kill()
                        core.process.join()
        if core.state is CoreState.RUNNING and self.on_restart is not None:
            self.on_restart(i)

    def stop(self) -> None:
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.join()
        for core in self.cores:
            if (core.process is not None and core.process.is_alive()
                    and core.state is CoreState.RUNNING):
                with contextlib.suppress(ReductionError, OSError):
                    self.ask(core, Stop())
            if core.process is not None:
                core.process.join(timeout=5)
                if core.process.is_alive():
                    core.process.kill()
                    core.process.join()
            if core.mailbox is not None:
                core.mailbox.close()
            core.move(CoreEvent.STOP)
        for core in self.cores:
            core.counters = Counters()  # drop the view before closing the shared memory
            core.memory.close()
            core.memory.unlink()
        self.cores.clear()

    def __enter__(self) -> Supervisor:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- mailbox ----
    def _exchange(self, core: CoreHandle, command: Command[R]) -> R:
        """Send one request and wait for its reply (the caller holds core.lock). Replies to
        requests that gave up earlier are recognised by their id and dropped."""
        return self._reply(core, self._post(core, command), command)

    def _post(self, core: CoreHandle, command: Command[R],
              pickled: tuple[Request, bytes] | None = None) -> Request:
        """Send one request (the caller holds core.lock); `_reply` waits for its answer.
        `pickled`: the request already made and pickled, for a command to every core."""
        mailbox = core.mailbox
        index = core.config.index
        if mailbox is None:
            raise CoreUnavailable(f"data-plane core {index} is {core.state.value}")
        request = pickled[0] if pickled else Request(next(self._ids), command)
        try:
            if pickled:
                mailbox.send_bytes(pickled[1])  # (what `send` sends: read with `recv`)
            else:
                mailbox.send(request)
        except OSError as exc:
            raise CoreUnavailable(f"data-plane core {index} died") from exc
        return request

    def _reply(self, core: CoreHandle, request: Request, command: Command[R]) -> R:
        """The answer to `request`, sent to `core` by `_post` (the caller still holds
        core.lock)."""
        mailbox = core.mailbox
        index = core.config.index
        assert mailbox is not None  # (_post found one, and core.lock was held since)
        # A running core answers between bursts: milliseconds normally.
        reply_s = self.cfg.dataplane.core_reply_timeout_s
        deadline = time.monotonic() + reply_s
        while True:
            if not mailbox.poll(max(0.0, deadline - time.monotonic())):
                what = f"no answer to {type(command).__name__} within {reply_s:g} s"
                self._stalled(core, what)
                raise CoreUnavailable(f"data-plane core {index} stalled ({what}); it is being "
                                      "restarted")
            try:
                reply = mailbox.recv()
            except (EOFError, OSError) as exc:
                raise CoreUnavailable(f"data-plane core {index} died") from exc
            if isinstance(reply, Reply) and reply.id == request.id:
                break
            if not isinstance(reply, Reply) or reply.id > request.id:
                raise CoreFailure(f"core {index} sent {reply!r} while {request.id} was asked")
        if reply.error is not None:
            raise reply.error.exception(index)
        if not isinstance(reply.value, command.reply_type):
            raise CoreFailure(f"core {index} answered {type(command).__name__} with "
                              f"{type(reply.value).__name__}, not {command.reply_type.__name__}")
        return cast(R, reply.value)

    def _stalled(self, core: CoreHandle, what: str) -> None:
        """A core that does not answer (stopped, wedged in a kernel call, looping) is killed:
        the monitor then restarts it like any core that died, and its jobs move on."""
        core.stalled = f"stalled: {what}; killed"
        _log.warning("data-plane core %d stalled (%s): killing it to restart it",
                     core.config.index, what)
        if core.process is not None and core.process.is_alive():
            core.process.kill()

    def ask(self, core: CoreHandle, command: Command[R]) -> R:
        with core.lock:
            if core.state is not CoreState.RUNNING:
                raise CoreUnavailable(f"data-plane core {core.config.index} is "
                                      f"{core.state.value}")
            return self._exchange(core, command)

    # ---- jobs (all cores or none) ----
    def add_job(self, spec: JobSpec) -> None:
        done: list[CoreHandle] = []
        try:
            for core in self.cores:
                self.ask(core, AddJob(spec))
                done.append(core)
        except ReductionError:
            for core in done:
                with contextlib.suppress(ReductionError):
                    self.ask(core, RemoveJob(spec.job_id))
            raise
        with self._jobs_lock:
            self.jobs[spec.job_id] = spec

    def update_job(self, spec: JobSpec) -> None:
        """New endpoints or a new epoch for a job every core has; a core that is restarting
        gets the latest spec when it is back. Raises the first core's refusal.

        Every core is asked at once, then each answer awaited: an update waits for one round
        trip instead of one per core (a job of 4096 ranks starting together waited seconds for
        its last join: benchmarks-journal.md, "A job of a thousand ranks")."""
        with self._jobs_lock:
            self.jobs[spec.job_id] = spec
        failures: list[ReductionError] = []
        command = UpdateJob(spec)
        with contextlib.ExitStack() as held:
            for core in self.cores:  # (their locks in index order, as no other path holds two)
                held.enter_context(core.lock)
            # Pickled once for every core (0.5 ms at 4096 ranks here). One id serves them all:
            # taken with every core's lock held, it is still the highest each core has seen.
            request = Request(next(self._ids), command)
            pickled = (request, bytes(ForkingPickler.dumps(request)))
            asked: list[CoreHandle] = []
            for core in self.cores:
                if core.state is not CoreState.RUNNING:
                    continue  # it gets self.jobs[...] (this spec) when it restarts
                with contextlib.suppress(CoreUnavailable):
                    self._post(core, command, pickled)
                    asked.append(core)
            for core in asked:
                try:
                    self._reply(core, request, command)
                except CoreUnavailable:
                    continue
                except ReductionError as exc:
                    failures.append(exc)
        if failures:
            raise failures[0]

    # ---- RDMA connections (config [roce]) ----
    def accept_queue_pairs(self, remotes: list[dict[str, Any]],
                           address: tuple[str, int]) -> list[dict[str, Any]]:
        """Connect one queue pair per core (remotes[i] to core i); the cores' ends, in order.
        A refusal from any core releases those already made."""
        if len(remotes) != len(self.cores):
            raise BadRequest(f"queue_pairs: one per data-plane core ({len(self.cores)}), "
                             f"got {len(remotes)}")
        made: list[dict[str, Any]] = []
        try:
            for core, remote in zip(self.cores, remotes, strict=True):
                made.append(self.ask(core, AcceptQueuePair(remote, address)))
        except ReductionError:
            self.release_queue_pairs((address,))
            raise
        return made

    def release_queue_pairs(self, addresses: tuple[tuple[str, int], ...]) -> None:
        for core in self.cores:
            with contextlib.suppress(CoreUnavailable):  # a restarted core has none left
                self.ask(core, ReleaseQueuePairs(addresses))

    def queue_pairs(self) -> list[list[dict[str, Any]]]:
        """Per core, its RDMA connections (a restarting core: none)."""
        out: list[list[dict[str, Any]]] = []
        for core in self.cores:
            try:
                out.append(self.ask(core, QueuePairs()))
            except CoreUnavailable:
                out.append([])
        return out

    def remove_job(self, job_id: int, *, abort: str | None = None) -> None:
        """Forget the job on every core; with `abort` (why, for the workers' error), its
        workers are told with ABORTED, at once and at their next datagrams, so they fail at
        once instead of at their deadline."""
        with self._jobs_lock:
            self.jobs.pop(job_id, None)
            self.disruptions.pop(job_id, None)
        for core in self.cores:
            with contextlib.suppress(CoreUnavailable):  # a restarting core gets the new list
                self.ask(core, RemoveJob(job_id) if abort is None
                         else AbortJob(job_id, abort))

    def fence(self, floors: tuple[tuple[int, int], ...],
              ended: tuple[tuple[int, tuple[int, ...]], ...] = ()) -> list[Fences]:
        """Drain these jobs (control.drain): what every running core says of them."""
        out: list[Fences] = []
        for core in self.cores:
            with contextlib.suppress(CoreUnavailable):
                out.append(self.ask(core, FenceJobs(floors, ended)))
        return out

    def probe(self) -> None:
        """Ask every running core for a reply (the janitor does, every second, jobs or not): a
        core that does not answer in time is stalled, and is killed to be restarted."""
        for core in self.cores:
            with contextlib.suppress(CoreUnavailable):
                self._note(core, self.ask(core, QueryStats(())))

    def _note(self, core: CoreHandle, stats: CoreStats) -> CoreStats:
        for what in stats.fallbacks:
            self.fallbacks.note(what, core.config.index)
        return stats

    def stats(self, job_ids: tuple[int, ...]) -> list[CoreStats]:
        """What every running core says about these jobs."""
        out: list[CoreStats] = []
        for core in self.cores:
            with contextlib.suppress(CoreUnavailable):
                out.append(self._note(core, self.ask(core, QueryStats(job_ids))))
        return out
