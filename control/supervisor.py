"""Starts the data-plane processes, one per configured core, and talks to their mailboxes.

Each core gets a pipe (its mailbox) and a small shared-memory array (its counters, which only it
writes). `Supervisor` is a context manager: leaving it stops every core and frees the memory.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.shared_memory import SharedMemory
from types import TracebackType

import numpy as np

from dataplane.aggregator import JobSpec
from dataplane.counters import N_COUNTERS, Counters
from dataplane.errors import AdmissionError, ReductionError
from dataplane.loop import AddJob, CoreConfig, Message, QueryWaiting, RemoveJob, Stop, run_core

from .config import ApplianceConfig

__all__ = ["CoreHandle", "Supervisor"]

_REPLY_TIMEOUT_S = 10.0


@dataclass
class CoreHandle:
    config: CoreConfig
    process: BaseProcess
    mailbox: Connection
    memory: SharedMemory
    counters: Counters
    lock: threading.Lock


class Supervisor:
    def __init__(self, cfg: ApplianceConfig) -> None:
        self.cfg = cfg
        self.cores: list[CoreHandle] = []

    def core_configs(self) -> list[CoreConfig]:
        dp = self.cfg.dataplane
        mc = self.cfg.multicast
        return [
            CoreConfig(
                index=i, cpu=dp.cpus[i] if dp.cpus else None,
                bind=(dp.address, dp.base_port + i), max_payload=dp.max_payload,
                slot_capacity=dp.slot_capacity, rx_buffers=dp.rx_buffers, poll=dp.poll,
                spin_us=dp.spin_us, multicast_interface=mc.interface_address or dp.address,
                kernels=None if dp.kernels == "auto" else dp.kernels,
            )
            for i in range(dp.cores)
        ]

    def start(self) -> None:
        # spawn, not fork: the API threads must not be duplicated into the data plane.
        ctx = mp.get_context("spawn")
        for core_cfg in self.core_configs():
            memory = SharedMemory(create=True, size=N_COUNTERS * 8)
            cells: np.ndarray = np.ndarray((N_COUNTERS,), np.uint64, buffer=memory.buf)
            cells[:] = 0
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=run_core, args=(core_cfg, theirs, memory.name),
                                  name=f"reductiond-core{core_cfg.index}", daemon=True)
            handle = CoreHandle(core_cfg, process, ours, memory, Counters(cells),
                                threading.Lock())
            self.cores.append(handle)
            process.start()
            theirs.close()
        for core in self.cores:
            self._expect(core, "ready")

    def _expect(self, core: CoreHandle, status: str) -> object:
        if not core.mailbox.poll(_REPLY_TIMEOUT_S):
            raise ReductionError(f"data-plane core {core.config.index} did not answer "
                                 f"within {_REPLY_TIMEOUT_S:g} s (alive: "
                                 f"{core.process.is_alive()})")
        got, value = core.mailbox.recv()
        if got == "error":
            raise AdmissionError(f"core {core.config.index}: {value}")
        if got != status:
            raise ReductionError(f"core {core.config.index} answered {got!r}, not {status!r}")
        return value

    def ask(self, core: CoreHandle, msg: Message) -> object:
        with core.lock:
            core.mailbox.send(msg)
            return self._expect(core, "ok")

    def add_job(self, spec: JobSpec) -> None:
        done: list[CoreHandle] = []
        try:
            for core in self.cores:
                self.ask(core, AddJob(spec))
                done.append(core)
        except ReductionError:
            for core in done:  # all cores or none
                self.ask(core, RemoveJob(spec.job_id))
            raise

    def remove_job(self, job_id: int) -> None:
        for core in self.cores:
            self.ask(core, RemoveJob(job_id))

    def waiting_ranks(self, job_id: int) -> dict[int, object]:
        return {c.config.index: self.ask(c, QueryWaiting(job_id)) for c in self.cores}

    def stop(self) -> None:
        for core in self.cores:
            if core.process.is_alive():
                with contextlib.suppress(ReductionError, OSError):
                    self.ask(core, Stop())
            core.process.join(timeout=5)
            if core.process.is_alive():
                core.process.kill()
                core.process.join()
            core.mailbox.close()
            del core.counters
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
