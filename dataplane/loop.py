"""The pinned poll loop of one data-plane core: a UDP socket, an aggregator, a mailbox.

The loop receives datagrams in bursts straight into the aggregator's receive buffers
(`recvmsg_into` scatters header and payload: no payload copy), applies the aggregator's `Send`
decisions with `sendmsg([header, payload])` (gather: no copy either), and between bursts reads
job changes from its mailbox. Poll modes: `busy` never blocks (a dedicated core); `adaptive`
spins for `spin_us` then blocks in `select`, so it shares a small machine politely.
"""

from __future__ import annotations

import os
import select
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Literal

import numpy as np

from .aggregator import Aggregator, JobSpec
from .counters import N_COUNTERS, Counter, Counters
from .reduce import select_kernels
from .slots import SlotArena
from .udp import DatagramBatcher, enlarge_buffers
from .wire import HEADER_SIZE, Kind, WireError, unpack

__all__ = ["AbortJob", "AddJob", "CoreConfig", "Message", "QueryStats", "RemoveJob", "Stop",
           "run_core"]

PollMode = Literal["busy", "adaptive"]
_MAILBOX_EVERY = 256  # busy mode: loop iterations between mailbox checks
_IDLE_BLOCK_S = 0.05  # adaptive mode: longest block, bounds mailbox latency
_SOCKET_BUFFER = 64 * 1024 * 1024  # holds a few full windows of every worker


@dataclass(frozen=True)
class CoreConfig:
    index: int
    cpu: int | None
    bind: tuple[str, int]
    max_payload: int
    slot_capacity: int
    rx_buffers: int
    poll: PollMode = "adaptive"
    spin_us: int = 200
    burst: int = 64
    multicast_interface: str | None = None  # local IPv4 address results are multicast from
    multicast_ttl: int = 1
    multicast_loop: bool = True  # deliver results to workers on this host too
    tos: int = 0  # IP TOS byte (DSCP << 2) marked on every datagram the core sends
    kernels: str | None = None


@dataclass(frozen=True)
class AddJob:
    spec: JobSpec


@dataclass(frozen=True)
class RemoveJob:
    job_id: int


@dataclass(frozen=True)
class AbortJob:
    job_id: int


@dataclass(frozen=True)
class QueryStats:
    job_ids: tuple[int, ...]


@dataclass(frozen=True)
class Stop:
    pass


Message = AddJob | RemoveJob | AbortJob | QueryStats | Stop


def open_socket(cfg: CoreConfig) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        enlarge_buffers(sock, _SOCKET_BUFFER)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, cfg.multicast_ttl)
        # Workers on the appliance's own host (loopback labs) must hear the multicast too.
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, int(cfg.multicast_loop))
        # Data traffic carries its class so switches can queue it apart (see steering.py).
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, cfg.tos)
        if cfg.multicast_interface:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF,
                            socket.inet_aton(cfg.multicast_interface))
        sock.bind(cfg.bind)
    except BaseException:
        sock.close()
        raise
    return sock


class CoreLoop:
    """One core's state; `run` until a `Stop` arrives."""

    def __init__(self, cfg: CoreConfig, mailbox: Connection, counters: Counters) -> None:
        self.cfg = cfg
        self.mailbox = mailbox
        self.counters = counters
        self.arena = SlotArena(cfg.slot_capacity, cfg.max_payload, cfg.rx_buffers)
        self.aggregator = Aggregator(self.arena, select_kernels(cfg.kernels), counters)
        self.sock = open_socket(cfg)
        self.batcher = DatagramBatcher(self.sock)
        self._header = bytearray(HEADER_SIZE)
        self._running = True

    def close(self) -> None:
        self.sock.close()
        self.arena.close()

    def handle(self, msg: Message) -> None:
        if isinstance(msg, AddJob):
            try:
                self.aggregator.add_job(msg.spec)
                self.mailbox.send(("ok", msg.spec.job_id))
            except Exception as exc:  # our refusal goes back to the control plane, not up
                self.mailbox.send(("error", str(exc)))
        elif isinstance(msg, RemoveJob):
            self.aggregator.remove_job(msg.job_id)
            self.mailbox.send(("ok", msg.job_id))
        elif isinstance(msg, AbortJob):
            for send in self.aggregator.abort_job(msg.job_id):
                self.batcher.add(send.dest, send.header, send.payload)
            self.batcher.flush()
            self.mailbox.send(("ok", msg.job_id))
        elif isinstance(msg, QueryStats):
            # Times inside stats are this process's monotonic clock: send "now" along so the
            # control plane can turn them into ages.
            stats = {j: self.aggregator.stats(j) for j in msg.job_ids}
            self.mailbox.send(("ok", (time.monotonic(), stats)))
        else:
            self._running = False
            self.mailbox.send(("ok", None))

    def drain_mailbox(self) -> None:
        while self.mailbox.poll():
            self.handle(self.mailbox.recv())

    def receive_burst(self) -> int:
        """Receive and process up to `burst` datagrams, then send what they finished (results
        of one burst to one group leave together, in GSO batches); return how many arrived."""
        sock = self.sock
        agg = self.aggregator
        batcher = self.batcher
        cells = self.counters.cells
        header = self._header
        got = nbytes_in = 0
        now = time.monotonic()
        for _ in range(self.cfg.burst):
            try:
                nbytes, _, flags, source = sock.recvmsg_into(
                    [header, agg.rx_view()], 0, socket.MSG_DONTWAIT
                )
            except BlockingIOError:
                break
            got += 1
            nbytes_in += nbytes
            if flags & socket.MSG_TRUNC:
                cells[Counter.DROP_TRUNCATED] += 1
                continue
            try:
                h = unpack(header)
            except WireError:
                cells[Counter.DROP_MALFORMED] += 1
                continue
            if nbytes < HEADER_SIZE or h.kind is not Kind.CONTRIBUTION:
                cells[Counter.DROP_MALFORMED] += 1
                continue
            for send in agg.on_contribution(h, nbytes - HEADER_SIZE, source, now):
                batcher.add(send.dest, send.header, send.payload)
        if got:
            # Counters move once per burst: one writer, readers see whole bursts.
            batcher.flush()
            sent, sent_bytes, errors = batcher.take_counts()
            cells[Counter.PACKETS_IN] += got
            cells[Counter.BYTES_IN] += nbytes_in
            cells[Counter.PACKETS_OUT] += sent
            cells[Counter.BYTES_OUT] += sent_bytes
            cells[Counter.SEND_ERRORS] += errors
        return got

    def run(self) -> None:
        busy = self.cfg.poll == "busy"
        spin_s = self.cfg.spin_us / 1e6
        cells = self.counters.cells
        loops = 0
        idle_since = time.perf_counter()
        while self._running:
            loops += 1
            cells[Counter.POLL_LOOPS] += 1
            if self.receive_burst():
                cells[Counter.POLL_BUSY_LOOPS] += 1
                idle_since = 0.0
                if loops % _MAILBOX_EVERY == 0:
                    self.drain_mailbox()
                continue
            if busy:
                if loops % _MAILBOX_EVERY == 0:
                    self.drain_mailbox()
                continue
            now = time.perf_counter()
            if not idle_since:
                idle_since = now
            if now - idle_since < spin_s:
                continue
            waitables: list[socket.socket | Connection] = [self.sock, self.mailbox]
            readable, _, _ = select.select(waitables, [], [], _IDLE_BLOCK_S)
            if self.mailbox in readable:
                self.drain_mailbox()


def run_core(cfg: CoreConfig, mailbox: Connection, counters_name: str) -> None:
    """Entry point of a data-plane process."""
    if cfg.cpu is not None:
        os.sched_setaffinity(0, {cfg.cpu})
    # Overflow to inf and inf - inf are data, not errors: the kernels must not warn per packet.
    np.seterr(all="ignore")
    try:
        import torch

        torch.set_num_threads(1)  # one core is one thread; kernels are per-segment small
    except ImportError:
        pass
    shm = SharedMemory(name=counters_name)
    try:
        cells: np.ndarray = np.ndarray((N_COUNTERS,), np.uint64, buffer=shm.buf)
        loop = CoreLoop(cfg, mailbox, Counters(cells))
        try:
            mailbox.send(("ready", cfg.index))
            loop.run()
        finally:
            loop.close()
            del cells
    finally:
        shm.close()
