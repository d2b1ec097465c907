"""Worker sessions and aggregators on the product's in-memory network, on a simulated clock.

Datagrams are real bytes (the wire format packs and unpacks them) carried by
`dataplane.transport.MemoryNetwork`; each aggregator sits behind the same `MemoryCoreTransport`
seam a core's loop drives. The network drops, duplicates and delays each datagram as a seeded
random generator says, so a failing case replays.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.counters import Counters
from reduction_appliance.dataplane.errors import JobDiverged
from reduction_appliance.dataplane.reduce import KernelTable
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import JobSpec
from reduction_appliance.dataplane.transport import (
    Address,
    MemoryCoreTransport,
    MemoryEndpoint,
    MemoryNetwork,
    RxBatch,
)
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    WRAP,
    DType,
    Header,
    Kind,
    Op,
    pack_into,
    unpack,
)
from reduction_appliance.plugin.congestion import Congestion, CongestionWindow
from reduction_appliance.plugin.pipeline import Outcome, RoundPipeline
from reduction_appliance.plugin.rtt import RttEstimator, Timing
from reduction_appliance.plugin.session import (
    AllreduceRound,
    Endpoint,
    SendOrder,
    SlotUses,
    Transmit,
)

MULTICAST = ("239.255.0.1", 7100)


@dataclass
class Faults:
    drop: float = 0.0
    duplicate: float = 0.0
    max_delay: float = 0.001  # uniform extra delay: reorders datagrams
    seed: int = 0


@dataclass
class Bottleneck:
    """The appliance's one link in: a FIFO drained at `rate` bytes/s that drops what finds
    more than `queue_s` of backlog waiting (tbf's limit, as the emulated rack has it)."""

    rate: float
    queue_s: float
    busy_until: float = 0.0
    dropped: int = 0
    longest_s: float = 0.0  # the longest wait any datagram had

    def enter(self, now: float, size: int) -> float | None:
        """The datagram's wait plus serialisation from `now`, or None: dropped."""
        start = max(now, self.busy_until)
        if start - now > self.queue_s:
            self.dropped += 1
            return None
        self.busy_until = start + size / self.rate
        self.longest_s = max(self.longest_s, start - now)
        return self.busy_until - now


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
    # Called before every step of the clock with the network: a test's adversary injects
    # datagrams there (`net.transmit(any source, any destination, any bytes)`); `tap` sees
    # every datagram sent.
    adversary: Callable[[MemoryNetwork], None] | None = None
    tap: Callable[[Address, Address, bytes], None] | None = None
    # Each rank's congestion window (plugin/congestion.py), kept across rounds; None: none.
    congestion: Congestion | None = None
    bottleneck: Bottleneck | None = None  # the appliance's link in; None: as fast as memory

    def __post_init__(self) -> None:
        self.rng = random.Random(self.faults.seed)
        self.net = MemoryNetwork(self._fault, self.tap)
        self.arenas = [SlotArena(max(8, self.slots), self.max_payload, 64)
                       for _ in range(self.cores)]
        self.aggregators = [Aggregator(a, self.kernels, Counters()) for a in self.arenas]
        self.spec = JobSpec(7, 0xC0FFEE, self.world, self.slots, self.deterministic,
                            MULTICAST if self.multicast else None,
                            endpoints=tuple(("worker", r) for r in range(self.world)),
                            hold_buffers=32 if self.deterministic else 0)
        for agg in self.aggregators:
            agg.add_job(self.spec, 0.0)
        self.core_transports = [MemoryCoreTransport(self.net.bind(("appliance", c)))
                                for c in range(self.cores)]
        self.worker_ends: list[MemoryEndpoint] = []
        for r in range(self.world):
            self.worker_ends.append(self.net.bind(("worker", r)))
            self.net.join(MULTICAST, ("worker", r))
        self.endpoints = tuple(
            Endpoint(("appliance", c), 7, 0xC0FFEE, self.slots, f"appliance core {c}")
            for c in range(self.cores)
        )
        self._cores = {ep.address for ep in self.endpoints}
        self.rtts = [RttEstimator(self.timing) for _ in range(self.world)]
        self.uses = [SlotUses() for _ in range(self.world)]  # each rank's, kept across rounds
        self.orders = [SendOrder(self.cores) for _ in range(self.world)]  # ... and these
        self.windows = [CongestionWindow([self.slots] * self.cores, self.congestion)
                        if self.congestion is not None else None for _ in range(self.world)]
        self.round = 0
        # Each rank's last round: when it ended, and whether it ended late (its last result
        # resent to it alone: AllreduceRound's `late`, as a worker's pipeline carries it)
        self.ended_at = [0.0] * self.world
        self.ended_late = [False] * self.world
        self._batch = RxBatch()
        self._header = bytearray(HEADER_SIZE)

    @property
    def now(self) -> float:
        return self.net.now

    def close(self) -> None:
        for t in self.core_transports:
            t.close()
        for e in self.worker_ends:
            e.close()
        for a in self.arenas:
            a.close()

    def _fault(self, source: Address, dest: Address, datagram: bytes) -> Sequence[float]:
        f = self.faults
        copies = 0 if self.rng.random() < f.drop else 1
        if copies and self.rng.random() < f.duplicate:
            copies = 2
        delays = [1e-5 + self.rng.random() * f.max_delay for _ in range(copies)]
        if self.bottleneck is not None and dest in self._cores:
            queued = [self.bottleneck.enter(self.net.now, len(datagram)) for _ in delays]
            delays = [d + q for d, q in zip(delays, queued, strict=True) if q is not None]
        return delays

    def _send(self, rank: int, due: list[Transmit],
              view: Callable[[Transmit], NDArray[np.uint8]]) -> None:
        for t in due:
            pack_into(self._header, t.header)
            payload = view(t)[t.header.offset:t.header.offset + t.header.length] \
                if t.header.kind is Kind.CONTRIBUTION else None  # a QUERY: its note
            body = payload.tobytes() if payload is not None else t.note
            self.worker_ends[rank].sendto(bytes(self._header) + body,
                                          self.endpoints[t.endpoint].address)

    def _tick(self, wake: float, receive: Callable[[int, Header, bytes, Address], None]) -> None:
        """Move the clock to the next event, let every core take its datagrams in (and send
        what they decide), then every worker."""
        if self.adversary is not None:
            self.adversary(self.net)
        self.net.advance(min(wake, self.net.next_arrival()))
        self._cores_take_in()
        for rank, end in enumerate(self.worker_ends):
            while (got := end.recv()) is not None:
                datagram, source = got
                receive(rank, unpack(datagram), datagram[HEADER_SIZE:], source)

    def _cores_take_in(self) -> None:
        """Every core takes in what has arrived, and sends what it decides."""
        for agg, transport in zip(self.aggregators, self.core_transports, strict=True):
            while transport.receive(agg.pool, self._batch, 64):
                transport.send(agg.on_batch(self._batch, self.now))

    def drain(self) -> None:
        """Deliver everything still in flight and let the cores take it in (what a round over
        before it arrived never saw: an adversary's late datagrams, say); workers ignore it."""
        while (arrival := self.net.next_arrival()) != float("inf"):
            self.net.advance(arrival)
            self._cores_take_in()

    def _wrap_in(self, pipelines: list[RoundPipeline], left: int) -> None:
        """Fast-forward a fresh job to `left` numbers before the wrap: what 2**32 - `left`
        rounds and uses would have left behind (white-box: no test runs four billion)."""
        for agg in self.aggregators:
            for slot in agg._jobs[self.spec.job_id].slots:
                slot.copies[slot.latest].use = WRAP - left
        for p in pipelines:
            p._next_round = WRAP - left + 1
            p.uses.counts.update({e << 32 | s: WRAP - left
                                  for e in range(self.cores) for s in range(self.slots)})

    def allreduce(self, arrays: list[NDArray[np.generic]], dtype: DType, op: Op,
                  order: list[int] | None = None, late: dict[int, float] | None = None
                  ) -> list[AllreduceRound]:
        """Run one round on every rank's array in place (ranks start in `order`; a rank in
        `late` that many seconds after the others)."""
        self.round += 1
        begins = [self.now + (late or {}).get(r, 0.0) for r in range(self.world)]
        rounds = [
            AllreduceRound(self.endpoints, r, self.world, self.round, dtype, op,
                           arrays[r].nbytes, self.max_payload, self.rtts[r], begins[r],
                           uses=self.uses[r], order=self.orders[r], window=self.windows[r],
                           late=self.ended_late[r])
            for r in range(self.world)
        ]
        views = [a.reshape(-1).view(np.uint8) for a in arrays]

        def receive(rank: int, h: Header, payload: bytes, source: Address) -> None:
            rnd = rounds[rank]
            if h.kind is Kind.PENDING:
                rnd.on_pending(h, payload, self.now, source)
                return
            if h.kind is Kind.MISSING:
                if h.rank == rank and source in self._cores:
                    for sent_by, k in self.orders[rank].segments(source[1], payload):
                        if sent_by is rnd:
                            rnd.missing(k)
                return
            if (h.kind is Kind.DIVERGED and source in self._cores
                    and (h.job_id, h.cookie) == (self.spec.job_id, self.spec.cookie)):
                raise JobDiverged(payload.decode(errors="replace"))
            k = rnd.accept(h, source)
            if k is not None:
                views[rank][h.offset:h.offset + h.length] = np.frombuffer(payload, np.uint8)
                rnd.stored(k, self.now, h.rank, h.flags)

        ended = [False] * self.world
        for r in order or range(self.world):
            if begins[r] <= self.now:
                self._send(r, rounds[r].due(self.now), lambda t, r=r: views[r])  # type: ignore[misc]
        while not all(r.done for r in rounds):
            self._tick(min(rnd.wakeup() if begins[r] <= self.now else begins[r]
                           for r, rnd in enumerate(rounds) if not rnd.done), receive)
            for r, rnd in enumerate(rounds):
                if rnd.done and not ended[r]:
                    ended[r] = True
                    self.ended_at[r], self.ended_late[r] = self.now, rnd.ended_late
                if not rnd.done and begins[r] <= self.now:
                    self._send(r, rnd.due(self.now), lambda t, r=r: views[r])  # type: ignore[misc]
        return rounds

    def allreduce_many(self, batches: list[list[NDArray[np.generic]]], dtype: DType, op: Op,
                       lanes: int, wrap_in: int | None = None) -> tuple[list[Outcome], int]:
        """Run several rounds (batches[i][rank] is rank's array of round i) through one
        `RoundPipeline` per rank with `lanes` lanes, all submitted at once. Returns rank 0's
        outcomes and the most rounds any rank had in flight at one time. `wrap_in`: start
        where a long job would be `wrap_in` rounds and slot uses before their numbers wrap
        (wire.WRAP), on every rank and core alike."""
        pipelines = [RoundPipeline(self.endpoints, r, self.world, self.max_payload,
                                   self.rtts[r], lanes, congestion=self.congestion)
                     for r in range(self.world)]
        if wrap_in is not None:
            self._wrap_in(pipelines, wrap_in)
        views: list[dict[int, NDArray[np.uint8]]] = [{} for _ in range(self.world)]
        for batch in batches:
            for r, p in enumerate(pipelines):
                views[r][p.submit(dtype, op, batch[r].nbytes)] = batch[r].reshape(-1).view(np.uint8)
        outcomes: list[list[Outcome]] = [[] for _ in range(self.world)]
        most = 0

        def receive(rank: int, h: Header, payload: bytes, source: Address) -> None:
            p = pipelines[rank]
            if h.kind is Kind.PENDING:
                p.on_pending(h, payload, self.now, source)
            elif h.kind is Kind.MISSING:
                p.on_missing(h, payload, source)
            elif h.kind is Kind.ABORTED:
                p.on_aborted(h, source, payload.decode(errors="replace"))
            elif (wanted := p.accept(h, source)) is not None:
                rnd, k = wanted
                views[rank][rnd.ticket][h.offset:h.offset + h.length] = np.frombuffer(
                    payload, np.uint8)
                p.stored(rnd, k, self.now, h.rank, h.flags)

        while not all(p.idle for p in pipelines):
            for r in range(self.world):
                self._send(r, pipelines[r].due(self.now),
                           lambda t, r=r: views[r][t.ticket])  # type: ignore[misc]
                outcomes[r].extend(pipelines[r].finished())
                most = max(most, pipelines[r].in_flight())
            wake = min(p.wakeup() for p in pipelines)
            if min(wake, self.net.next_arrival()) == float("inf"):
                break
            self._tick(wake, receive)
        for r, p in enumerate(pipelines):
            outcomes[r].extend(p.finished())
        return outcomes[0], most
