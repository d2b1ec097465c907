"""Starts the data-plane processes, one per configured core, keeps them alive, and talks to them.

Each core gets a pipe (its mailbox) and a small shared-memory array (its counters, which only it
writes). A monitor thread waits on the processes: a core that dies is restarted with
exponential backoff, gets every current job again, and the event is recorded for the jobs that
had traffic on it (status shows it; their workers either complete by retransmission to the new
process, or get a clear timeout error naming that core). `Supervisor` is a context manager:
leaving it stops every core and frees the memory.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.shared_memory import SharedMemory
from types import TracebackType
from typing import Any, cast

import numpy as np

from dataplane.aggregator import JobSpec, JobStats
from dataplane.counters import N_COUNTERS, Counters
from dataplane.errors import AdmissionError, ReductionError
from dataplane.loop import (
    AbortJob,
    AddJob,
    CoreConfig,
    Message,
    QueryStats,
    RemoveJob,
    Stop,
    run_core,
)

from .config import ApplianceConfig

__all__ = ["CoreHandle", "CoreUnavailable", "Supervisor"]

_REPLY_TIMEOUT_S = 30.0  # a spawned core imports numpy (and torch) before it answers
_BACKOFF_FIRST_S = 0.2
_BACKOFF_MAX_S = 10.0
_STABLE_S = 30.0  # running this long resets the backoff


class CoreUnavailable(ReductionError):
    """A data-plane core is not running right now (restarting after a crash). Retry shortly."""


@dataclass
class CoreHandle:
    config: CoreConfig
    memory: SharedMemory
    counters: Counters
    lock: threading.Lock = field(default_factory=threading.Lock)
    process: BaseProcess | None = None
    mailbox: Connection | None = None
    state: str = "starting"  # starting, running, restarting, stopped
    restarts: int = 0
    started_at: float = 0.0
    last_exit: str = ""


@dataclass(frozen=True)
class Disruption:
    core: int
    at: float  # time.time()
    why: str


class Supervisor:
    def __init__(self, cfg: ApplianceConfig) -> None:
        self.cfg = cfg
        self.cores: list[CoreHandle] = []
        self.jobs: dict[int, JobSpec] = {}  # what every running core has been told
        self.disruptions: dict[int, list[Disruption]] = {}  # job id -> core restarts it saw
        self._ctx = mp.get_context("spawn")  # not fork: API threads must not be duplicated
        self._stopping = threading.Event()
        self._jobs_lock = threading.Lock()
        self._monitor: threading.Thread | None = None

    def core_configs(self) -> list[CoreConfig]:
        dp = self.cfg.dataplane
        mc = self.cfg.multicast
        return [
            CoreConfig(
                index=i, cpu=dp.cpus[i] if dp.cpus else None,
                bind=(dp.address, dp.base_port + i), max_payload=dp.max_payload,
                slot_capacity=dp.slot_capacity, rx_buffers=dp.rx_buffers, poll=dp.poll,
                spin_us=dp.spin_us, multicast_interface=mc.interface_address or dp.address,
                multicast_loop=mc.loop, tos=dp.dscp << 2,
                kernels=None if dp.kernels == "auto" else dp.kernels,
            )
            for i in range(dp.cores)
        ]

    # ---- lifecycle ----
    def start(self) -> None:
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
        self._expect(core, "ready")
        core.state = "running"
        core.started_at = time.monotonic()

    def _watch(self) -> None:
        """Restart cores that die, with backoff, until stop()."""
        failures = [0] * len(self.cores)
        while not self._stopping.is_set():
            sentinels = {c.process.sentinel: c for c in self.cores
                         if c.process is not None and c.state == "running"}
            for ready in wait(list(sentinels), timeout=0.5):
                if self._stopping.is_set():
                    return
                core = sentinels[ready]  # type: ignore[index]
                assert core.process is not None
                core.process.join(timeout=1)  # reap it: exitcode is None until then
                code = core.process.exitcode
                core.last_exit = f"exit code {code}" if code is None or code >= 0 \
                    else f"killed by signal {-code}"
                self._restart(core, failures)

    def _restart(self, core: CoreHandle, failures: list[int]) -> None:
        i = core.config.index
        if time.monotonic() - core.started_at > _STABLE_S:
            failures[i] = 0
        with core.lock:
            core.state = "restarting"
            core.restarts += 1
            if core.mailbox is not None:
                core.mailbox.close()
            with self._jobs_lock:
                for job_id in self.jobs:
                    self.disruptions.setdefault(job_id, []).append(
                        Disruption(i, time.time(), f"core {i} {core.last_exit}; restarted"))
            delay = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** failures[i])
            failures[i] += 1
            if self._stopping.wait(delay):
                return
            try:
                self._spawn(core)
                self._await_ready(core)
                with self._jobs_lock:
                    specs = list(self.jobs.values())
                for spec in specs:
                    self._send(core, AddJob(spec))
            except (ReductionError, OSError) as exc:
                core.last_exit = f"restart failed: {exc}"
                core.state = "running"  # the watcher sees the dead process and tries again

    def stop(self) -> None:
        self._stopping.set()
        if self._monitor is not None:
            self._monitor.join()
        for core in self.cores:
            if core.process is not None and core.process.is_alive() and core.state == "running":
                with contextlib.suppress(ReductionError, OSError):
                    self.ask(core, Stop())
            if core.process is not None:
                core.process.join(timeout=5)
                if core.process.is_alive():
                    core.process.kill()
                    core.process.join()
            if core.mailbox is not None:
                core.mailbox.close()
            core.state = "stopped"
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
    def _expect(self, core: CoreHandle, status: str) -> object:
        assert core.mailbox is not None
        if not core.mailbox.poll(_REPLY_TIMEOUT_S):
            alive = core.process is not None and core.process.is_alive()
            raise ReductionError(f"data-plane core {core.config.index} did not answer "
                                 f"within {_REPLY_TIMEOUT_S:g} s (alive: {alive})")
        try:
            got, value = core.mailbox.recv()
        except (EOFError, OSError) as exc:
            raise CoreUnavailable(f"data-plane core {core.config.index} died") from exc
        if got == "error":
            raise AdmissionError(f"core {core.config.index}: {value}")
        if got != status:
            raise ReductionError(f"core {core.config.index} answered {got!r}, not {status!r}")
        return value

    def _send(self, core: CoreHandle, msg: Message) -> object:
        assert core.mailbox is not None
        try:
            core.mailbox.send(msg)
        except OSError as exc:
            raise CoreUnavailable(f"data-plane core {core.config.index} died") from exc
        return self._expect(core, "ok")

    def ask(self, core: CoreHandle, msg: Message) -> object:
        with core.lock:
            if core.state != "running":
                raise CoreUnavailable(f"data-plane core {core.config.index} is {core.state}")
            return self._send(core, msg)

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

    def remove_job(self, job_id: int, *, abort: bool = False) -> None:
        """Forget the job on every core; with `abort`, its workers' next datagrams are
        answered with ABORTED so they fail at once instead of at their deadline."""
        with self._jobs_lock:
            self.jobs.pop(job_id, None)
            self.disruptions.pop(job_id, None)
        for core in self.cores:
            with contextlib.suppress(CoreUnavailable):  # a restarting core gets the new list
                self.ask(core, AbortJob(job_id) if abort else RemoveJob(job_id))

    def stats(self, job_ids: tuple[int, ...]) -> list[tuple[float, dict[int, JobStats | None]]]:
        """Per running core: (its monotonic now, job id -> stats)."""
        out: list[tuple[float, dict[int, JobStats | None]]] = []
        for core in self.cores:
            with contextlib.suppress(CoreUnavailable):
                reply = self.ask(core, QueryStats(job_ids))
                out.append(cast(tuple[float, dict[int, JobStats | None]], reply))
        return out
