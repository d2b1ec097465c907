"""The pinned poll loop of one data-plane core: a transport, an aggregator, a mailbox.

The loop takes bursts of datagrams from its `CoreTransport` (straight into the aggregator's
receive buffers), hands each burst to the aggregator, applies the `Send` decisions it returns
through the same transport, and between bursts serves its mailbox (`dataplane.spec`). It knows
nothing about sockets. Poll modes: `busy` never blocks (a dedicated core); `adaptive` spins for
at most `spin_us` then blocks in `select`, so it shares a small machine politely: how long it
spins follows how long its idle periods have been lasting (dataplane/spin.py).
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from .aggregator import Aggregator
from .counters import N_COUNTERS, Counter, Counters
from .errors import Conflict
from .reduce import select_kernels
from .slots import SlotArena
from .spec import (
    AbortJob,
    AcceptQueuePair,
    AddJob,
    Command,
    CoreConfig,
    CoreStats,
    ErrorReport,
    FenceJobs,
    Fences,
    QueryStats,
    QueuePairs,
    Ready,
    ReleaseQueuePairs,
    RemoveJob,
    Reply,
    Request,
    Stop,
    UpdateJob,
)
from .spin import IdleBlocks, SpinWindow
from .transport import CoreTransport, RxBatch, Send
from .udp import UdpCoreTransport
from .verbs import QpEndpoint

__all__ = ["CoreLoop", "run_core"]

_MAILBOX_EVERY = 256  # busy mode: loop iterations between mailbox checks
_IDLE_BLOCK_S = 0.05  # adaptive mode: longest block, bounds mailbox latency
_FIRST_BLOCK_S = 50e-6  # adaptive mode, a transport without a descriptor: the first block
_TEND_S = 0.1  # how often the loop looks for closed ports and silent ranks (`tend`)


class CoreLoop:
    """One core's state; `run` until a `Stop` arrives. Tests drive `receive_burst` and
    `serve` directly, with an in-memory transport and their own clock."""

    def __init__(self, cfg: CoreConfig, mailbox: Connection, counters: Counters,
                 transport: CoreTransport, clock: Callable[[], float] = time.monotonic,
                 arena: SlotArena | None = None) -> None:
        self.cfg = cfg
        self.mailbox = mailbox
        self.counters = counters
        self.clock = clock
        # Given when the transport was built over it (RDMA registers the arena's memory).
        self.arena = arena or SlotArena(cfg.slot_capacity, cfg.max_payload, cfg.rx_buffers)
        self.kernels = select_kernels(cfg.kernels)
        self.aggregator = Aggregator(self.arena, self.kernels, counters)
        self.transport = transport
        self._batch = RxBatch()
        self._running = True
        self.spin = SpinWindow(cfg.spin_us / 1e6)  # (adaptive poll mode)

    def close(self) -> None:
        self.transport.close()
        self.arena.close()

    def fallbacks(self) -> tuple[str, ...]:
        """What this core gave up here, and why (status shows it; the daemon logs it once)."""
        skipped = self.kernels.passed_over
        kernels = (f"reduce kernels {self.kernels.backend}, not {'; '.join(skipped)}",) \
            if skipped else ()
        return kernels + self.transport.fallbacks()

    # ---- mailbox ----
    def execute(self, command: Command[object]) -> object:
        """Apply one control-plane command; what it returns is the reply value."""
        agg = self.aggregator
        if isinstance(command, AddJob):
            self._send(agg.add_job(command.spec, self.clock()))
            return None
        if isinstance(command, UpdateJob):
            self._send(agg.update_job(command.spec, self.clock()))
            return None
        if isinstance(command, RemoveJob):
            agg.remove_job(command.job_id)
            return None
        if isinstance(command, AbortJob):
            self._send(agg.abort_job(command.job_id, command.reason))
            return None
        if isinstance(command, FenceJobs):
            now = self.clock()
            ended = dict(command.ended)
            return Fences({job: agg.fence(job, floor, now, frozenset(ended.get(job, ())))
                           for job, floor in command.floors})
        if isinstance(command, QueryStats):
            now = self.clock()
            return CoreStats(now, {j: agg.stats(j, now) for j in command.job_ids},
                             self.fallbacks())
        if isinstance(command, AcceptQueuePair | QueuePairs | ReleaseQueuePairs):
            return self._queue_pairs(command)
        if isinstance(command, Stop):
            self._running = False
            return None
        raise TypeError(f"unknown mailbox command {type(command).__name__}")

    def _queue_pairs(self, command: Command[Any]) -> object:
        roce = getattr(self.transport, "roce", None)
        if isinstance(command, QueuePairs):
            return roce.queue_pairs() if roce is not None else []
        if roce is None:
            if isinstance(command, ReleaseQueuePairs):
                return None
            raise Conflict(f"core {self.cfg.index} has no RDMA device (config [roce])")
        if isinstance(command, ReleaseQueuePairs):
            for address in command.addresses:
                roce.disconnect(address)
            return None
        assert isinstance(command, AcceptQueuePair)
        local = roce.accept(QpEndpoint.from_json(command.remote), command.address)
        return local.as_json()

    def serve(self, request: Request) -> Reply:
        """Execute a request; a refusal or a failure goes back to the control plane as an
        `ErrorReport` (its class name and text) and the core goes on serving."""
        try:
            return Reply(request.id, self.execute(request.command))
        except Exception as exc:
            return Reply(request.id, error=ErrorReport.of(exc))

    def drain_mailbox(self) -> None:
        while self._running and self.mailbox.poll():
            request = self.mailbox.recv()
            if not isinstance(request, Request):
                # Not even an envelope: nothing to correlate a reply with. Say so anyway.
                self.mailbox.send(Reply(-1, error=ErrorReport(
                    "TypeError", f"not a Request: {type(request).__name__}")))
                continue
            self.mailbox.send(self.serve(request))

    # ---- datagrams ----
    def _send(self, sends: Sequence[Send]) -> None:
        if sends:
            self.transport.send(sends)

    def tend(self, now: float) -> None:
        """What no datagram prompts: the ports found closed since the last call, REACHes to the
        ranks a slot waits for that fell silent, and word to the others of those that ended
        (dataplane.reach), where the transport can tell closed ports."""
        closed = self.transport.closed_ports()
        if closed is not None:
            self._send(self.aggregator.reach(closed, now))

    def _tended(self, due: float) -> float:
        """`tend` if it is `due`; when it is due next."""
        now = self.clock()
        if now < due:
            return due
        self.tend(now)
        return now + _TEND_S

    def receive_burst(self) -> int:
        """Receive and process up to `burst` datagrams, then send what they finished (results
        of one burst to one group leave together, in GSO batches); return how many arrived."""
        batch = self._batch
        got = self.transport.receive(self.aggregator.pool, batch, self.cfg.burst)
        if not got and not batch.truncated:
            return 0
        self._send(self.aggregator.on_batch(batch, self.clock()))
        counts = self.transport.take_counts()
        # Counters move once per burst: one writer, readers see whole bursts.
        cells = self.counters.cells
        cells[Counter.PACKETS_IN] += got + batch.truncated
        cells[Counter.BYTES_IN] += batch.bytes
        cells[Counter.DROP_TRUNCATED] += batch.truncated
        cells[Counter.PACKETS_OUT] += counts.datagrams_sent
        cells[Counter.BYTES_OUT] += counts.bytes_sent
        cells[Counter.SEND_ERRORS] += counts.send_errors
        return got + batch.truncated

    def run(self) -> None:
        busy = self.cfg.poll == "busy"
        spin = self.spin
        cells = self.counters.cells
        loops = 0
        idle_since = 0.0  # when the loop first found nothing to do (0: it is busy)
        mailbox_fd = self.mailbox.fileno()
        # What no descriptor announces (RDMA completions: see dataplane.verbs) cannot wake the
        # select: a transport that has some says how long an idle loop may block, and the loop
        # polls again after a block that doubles from 50 us up to that (a few wakeups per ms
        # at first, a few hundred per second when idle), and up to the mailbox bound once idle
        # for seconds (a few dozen per second: dataplane/spin.py's IdleBlocks).
        transport_fd = self.transport.fileno()
        waitables = [transport_fd, mailbox_fd] if transport_fd >= 0 else [mailbox_fd]
        longest_s = min(_IDLE_BLOCK_S, self.transport.idle_block_s)
        first_s = longest_s if longest_s >= _IDLE_BLOCK_S else min(longest_s, _FIRST_BLOCK_S)
        blocks = IdleBlocks(first_s, longest_s, _IDLE_BLOCK_S)
        tend_at = 0.0
        while self._running:
            loops += 1
            cells[Counter.POLL_LOOPS] += 1
            polled = time.perf_counter() if idle_since else 0.0  # (before the burst's work)
            if self.receive_burst():
                cells[Counter.POLL_BUSY_LOOPS] += 1
                if idle_since:
                    spin.idle_ended(polled - idle_since)
                idle_since = 0.0
                blocks.restart()
                if loops % _MAILBOX_EVERY == 0:
                    self.drain_mailbox()
                    tend_at = self._tended(tend_at)
                continue
            if busy:
                if loops % _MAILBOX_EVERY == 0:
                    self.drain_mailbox()
                    tend_at = self._tended(tend_at)
                continue
            now = polled or time.perf_counter()
            if not idle_since:
                idle_since = now
            if now - idle_since < spin.window_s:
                continue
            readable, _, _ = select.select(waitables, [], [], blocks.block_s)
            blocks.blocked(now - idle_since)
            if mailbox_fd in readable:
                self.drain_mailbox()
            tend_at = self._tended(tend_at)


def _open(cfg: CoreConfig, mailbox: Connection, counters: Counters) -> CoreLoop:
    """The core's loop over UDP, or over UDP and RoCE (its arena registered for the NIC)."""
    if cfg.roce is None:
        return CoreLoop(cfg, mailbox, counters, UdpCoreTransport.open(cfg))
    from .dual import DualCoreTransport
    from .roce import RoceCoreTransport
    from .verbs import RoceDevice

    settings = cfg.roce
    with contextlib.ExitStack() as stack:
        arena = stack.enter_context(SlotArena(cfg.slot_capacity, cfg.max_payload,
                                              cfg.rx_buffers))
        udp = UdpCoreTransport.open(cfg)
        stack.callback(udp.close)
        device = RoceDevice(settings.device, port=settings.port, gid_index=settings.gid_index)
        stack.callback(device.close)
        roce = RoceCoreTransport(device, arena, counters, peers=settings.queue_pairs,
                                 send_depth=settings.send_depth)
        loop = CoreLoop(cfg, mailbox, counters, DualCoreTransport(udp, roce), arena=arena)
        stack.pop_all()
    return loop


def run_core(cfg: CoreConfig, mailbox: Connection, counters_name: str) -> None:
    """Entry point of a data-plane process."""
    if cfg.cpu is not None:
        os.sched_setaffinity(0, {cfg.cpu})
    # Overflow to inf and inf - inf are data, not errors: the kernels must not warn per packet.
    np.seterr(all="ignore")
    if cfg.kernels != "numpy":  # told numpy: never pay torch's import (seconds on a slow host)
        try:
            import torch

            torch.set_num_threads(1)  # one core is one thread; kernels are per-segment small
        except ImportError:
            pass
    shm = SharedMemory(name=counters_name)
    try:
        cells: np.ndarray = np.ndarray((N_COUNTERS,), np.uint64, buffer=shm.buf)
        try:
            loop = _open(cfg, mailbox, Counters(cells))
        except Exception as exc:
            # Instead of Ready: why this core cannot start (a bad kernel backend, a port in
            # use). The supervisor raises it as the same class.
            mailbox.send(ErrorReport.of(exc))
            return
        try:
            mailbox.send(Ready(cfg.index, loop.kernels.backend, loop.fallbacks()))
            loop.run()
        finally:
            loop.close()
            del cells
    finally:
        shm.close()
