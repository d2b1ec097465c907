"""An in-memory network between worker sessions and aggregators, on a simulated clock.

Datagrams are real bytes (the wire format packs and unpacks them); the network drops,
duplicates and delays each one as a seeded random generator says, so a failing case replays.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from dataplane.aggregator import Aggregator, JobSpec
from dataplane.counters import Counters
from dataplane.reduce import KernelTable
from dataplane.slots import SlotArena
from dataplane.wire import HEADER_SIZE, DType, Header, Kind, Op, pack_into, unpack
from plugin.pipeline import Outcome, RoundPipeline
from plugin.session import AllreduceRound, Endpoint, RttEstimator, Timing

MULTICAST = ("239.255.0.1", 7100)


@dataclass
class Faults:
    drop: float = 0.0
    duplicate: float = 0.0
    max_delay: float = 0.001  # uniform extra delay: reorders datagrams
    seed: int = 0


@dataclass
class SimNet:
    kernels: KernelTable
    world: int
    cores: int = 2
    slots: int = 4
    max_payload: int = 256
    deterministic: bool = False
    multicast: bool = True
    faults: Faults = field(default_factory=Faults)
    timing: Timing = field(default_factory=lambda: Timing(0.01, 0.002, 0.2, 30.0))

    def __post_init__(self) -> None:
        self.rng = random.Random(self.faults.seed)
        self.arenas = [SlotArena(8, self.max_payload, 64) for _ in range(self.cores)]
        self.aggregators = [Aggregator(a, self.kernels, Counters()) for a in self.arenas]
        self.spec = JobSpec(7, 0xC0FFEE, self.world, self.slots, self.deterministic,
                            MULTICAST if self.multicast else None)
        for agg in self.aggregators:
            agg.add_job(self.spec)
        self.endpoints = tuple(
            Endpoint(("appliance", c), 7, 0xC0FFEE, self.slots, f"appliance core {c}")
            for c in range(self.cores)
        )
        self.rtts = [RttEstimator(self.timing) for _ in range(self.world)]
        self.round = 0
        self.now = 0.0
        self._queue: list[tuple[float, int, tuple[str, int], bytes]] = []
        self._seq = 0

    def close(self) -> None:
        for a in self.arenas:
            a.close()

    def _transmit(self, dest: tuple[str, int], datagram: bytes) -> None:
        f = self.faults
        copies = 0 if self.rng.random() < f.drop else 1
        if copies and self.rng.random() < f.duplicate:
            copies = 2
        for _ in range(copies):
            self._seq += 1
            when = self.now + 1e-5 + self.rng.random() * f.max_delay
            heapq.heappush(self._queue, (when, self._seq, dest, datagram))

    def allreduce(self, arrays: list[NDArray[np.generic]], dtype: DType, op: Op,
                  order: list[int] | None = None) -> list[AllreduceRound]:
        """Run one round on every rank's array in place (ranks start in `order`)."""
        self.round += 1
        start = self.now
        rounds = [
            AllreduceRound(self.endpoints, r, self.world, self.round, dtype, op,
                           arrays[r].nbytes, self.max_payload, self.rtts[r], start)
            for r in range(self.world)
        ]
        views = [a.reshape(-1).view(np.uint8) for a in arrays]
        hdr = bytearray(HEADER_SIZE)
        for r in order or range(self.world):
            self._send_due(rounds[r], views[r], hdr, r)
        while not all(r.done for r in rounds):
            wake = min(r.wakeup() for r in rounds if not r.done)
            nxt = self._queue[0][0] if self._queue else wake
            self.now = max(self.now, min(wake, nxt))
            if self._queue and self._queue[0][0] <= self.now:
                _, _, dest, datagram = heapq.heappop(self._queue)
                self._deliver(dest, datagram, lambda rank, h, payload: self._worker_receives(
                    rounds[rank], views[rank], h, payload))
            for r, rnd in enumerate(rounds):
                if not rnd.done:
                    self._send_due(rnd, views[r], hdr, r)
        return rounds

    def _send_due(self, rnd: AllreduceRound, view: NDArray[np.uint8], hdr: bytearray,
                  rank: int) -> None:
        for t in rnd.due(self.now):
            pack_into(hdr, t.header)
            payload = view[t.header.offset:t.header.offset + t.header.length].tobytes()
            self._transmit(self.endpoints[t.endpoint].address, bytes(hdr) + payload)

    def allreduce_many(self, batches: list[list[NDArray[np.generic]]], dtype: DType, op: Op,
                       lanes: int) -> tuple[list[Outcome], int]:
        """Run several rounds (batches[i][rank] is rank's array of round i) through one
        `RoundPipeline` per rank with `lanes` lanes, all submitted at once. Returns rank 0's
        outcomes and the most rounds any rank had in flight at one time."""
        pipelines = [RoundPipeline(self.endpoints, r, self.world, self.max_payload,
                                   self.rtts[r], lanes) for r in range(self.world)]
        views: list[dict[int, NDArray[np.uint8]]] = [{} for _ in range(self.world)]
        for batch in batches:
            for r, p in enumerate(pipelines):
                views[r][p.submit(dtype, op, batch[r].nbytes)] = batch[r].reshape(-1).view(np.uint8)
        outcomes: list[list[Outcome]] = [[] for _ in range(self.world)]
        most = 0
        hdr = bytearray(HEADER_SIZE)

        def send_due(r: int) -> None:
            for t in pipelines[r].due(self.now):
                pack_into(hdr, t.header)
                view = views[r][t.header.round]
                payload = view[t.header.offset:t.header.offset + t.header.length].tobytes()
                self._transmit(self.endpoints[t.endpoint].address, bytes(hdr) + payload)

        def receive(rank: int, h: Header, payload: bytes) -> None:
            p = pipelines[rank]
            if h.kind is Kind.PENDING:
                p.on_pending(h, payload)
            elif h.kind is Kind.ABORTED:
                p.on_aborted(h)
            elif (wanted := p.accept(h)) is not None:
                views[rank][h.round][h.offset:h.offset + h.length] = np.frombuffer(payload,
                                                                                   np.uint8)
                p.stored(*wanted, self.now)

        while not all(p.idle for p in pipelines):
            for r in range(self.world):
                send_due(r)
                outcomes[r].extend(pipelines[r].finished())
                most = max(most, pipelines[r].in_flight())
            wake = min(p.wakeup() for p in pipelines)
            nxt = self._queue[0][0] if self._queue else wake
            if nxt == float("inf"):
                break
            self.now = max(self.now, min(wake, nxt))
            if self._queue and self._queue[0][0] <= self.now:
                _, _, dest, datagram = heapq.heappop(self._queue)
                self._deliver(dest, datagram, receive)
        for r, p in enumerate(pipelines):
            outcomes[r].extend(p.finished())
        return outcomes[0], most

    def _deliver(self, dest: tuple[str, int], datagram: bytes,
                 receive: Callable[[int, Header, bytes], None]) -> None:
        h = unpack(datagram)
        if dest[0] == "appliance":
            agg = self.aggregators[dest[1]]
            payload = datagram[HEADER_SIZE:]
            agg.rx_view()[:len(payload)] = payload
            for send in agg.on_contribution(h, len(payload), ("worker", h.rank)):
                out = bytes(send.header) + bytes(send.payload)
                if send.dest == MULTICAST:
                    for r in range(self.world):
                        self._transmit(("worker", r), out)
                else:
                    self._transmit(send.dest, out)
            return
        receive(dest[1], h, datagram[HEADER_SIZE:])

    def _worker_receives(self, rnd: AllreduceRound, view: NDArray[np.uint8], h: Header,
                         payload: bytes) -> None:
        if h.kind is Kind.PENDING:
            rnd.on_pending(h, payload)
            return
        k = rnd.accept(h)
        if k is not None:
            view[h.offset:h.offset + h.length] = np.frombuffer(payload, np.uint8)
            rnd.stored(k, self.now)
