"""Sans-I/O worker core of one allreduce round: which segments to send when, and what to accept.

The tensor's bytes are cut into segments of `segment_bytes`. Segment k goes to endpoint
k mod E (an appliance core), where it is the m = k div E-th segment and uses slot m mod S.
Self-clocking: the next segment for a slot (k + S*E) is released only when the result of k came
back, which is also what lets the appliance reuse a slot copy safely. Each first transmission
on a slot takes that slot's next use number (`SlotUses`, shared by the rounds of one rank and
counted alike by every rank), which the appliance checks against its window. Unanswered
segments are retransmitted after an adaptive timeout (Karn's rule, exponential backoff up to
`rto_max`). Results are accepted only from the core the segment went to, for its use and epoch.

The transport asks `due(now)` what to send, offers each received RESULT header to `accept`, and
reports `stored` once the payload sits in the output array. Nothing here touches a socket or a
clock: time is passed in, so tests run thousands of lossy rounds in milliseconds.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from reduction_appliance.dataplane.errors import AllreduceTimeout, JobAborted, ReductionError
from reduction_appliance.dataplane.wire import DType, Flags, Header, Kind, Op

__all__ = ["AllreduceRound", "Endpoint", "RttEstimator", "SlotUses", "Timing", "Transmit"]

Address = tuple[str, int]


@dataclass(frozen=True)
class Endpoint:
    """One data-plane core of one appliance, as the job's registration described it."""

    address: Address
    job_id: int
    cookie: int
    slots: int
    name: str
    slot_base: int = 0  # this round uses slots slot_base .. slot_base + slots - 1 (its lane)


@dataclass(frozen=True)
class Timing:
    rto_initial: float = 0.1
    rto_min: float = 0.02
    rto_max: float = 1.0
    deadline: float = 60.0


@dataclass
class RttEstimator:
    """Smoothed round-trip time (RFC 6298), carried from one round to the next."""

    timing: Timing = field(default_factory=Timing)
    srtt: float | None = None
    rttvar: float = 0.0
    backoff: int = 0  # timeouts since the last valid sample: the RTO doubles for each

    def sample(self, rtt: float) -> None:
        self.backoff = 0
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt

    def timed_out(self) -> None:
        """A segment went unanswered: like TCP, back the whole estimate off (not only that
        segment's timer) until a fresh sample shows the path is fast again. Under CPU
        contention RTTs have a heavy tail; without this, one stall retransmits every segment
        in flight and the extra load makes the next stall longer."""
        self.backoff = min(self.backoff + 1, 6)

    @property
    def rto(self) -> float:
        t = self.timing
        base = t.rto_initial if self.srtt is None else self.srtt + 4 * self.rttvar
        return min(t.rto_max, max(t.rto_min, base) * (1 << self.backoff))


class Transmit(NamedTuple):
    endpoint: int
    segment: int
    header: Header
    ticket: int  # the round as its submitter knows it (see pipeline.RoundPipeline.submit)


class SlotUses:
    """How many times each slot has been used this epoch, by (endpoint, slot). Every rank runs
    the same rounds in the same order, so every rank numbers a slot's uses alike."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: dict[tuple[int, int], int] = {}

    def take(self, endpoint: int, slot: int) -> int:
        """The next use of `slot` on `endpoint` (1 for the first)."""
        key = (endpoint, slot)
        use = self._count.get(key, 0) + 1
        self._count[key] = use
        return use

    def reset(self) -> None:
        """A new epoch: every slot starts over."""
        self._count.clear()


class AllreduceRound:
    """One allreduce of `nbytes` bytes by this rank."""

    def __init__(
        self,
        endpoints: tuple[Endpoint, ...],
        rank: int,
        world_size: int,
        round_no: int,
        dtype: DType,
        op: Op,
        nbytes: int,
        segment_bytes: int,
        rtt: RttEstimator,
        now: float,
        *,
        uses: SlotUses | None = None,
        epoch: int = 1,
        ticket: int | None = None,
    ) -> None:
        if not endpoints:
            raise ReductionError("an allreduce needs at least one appliance endpoint")
        if segment_bytes < dtype.itemsize or segment_bytes % dtype.itemsize:
            raise ReductionError(f"segment size {segment_bytes} is not a multiple of {dtype.name}")
        if nbytes % dtype.itemsize:
            raise ReductionError(f"{nbytes} bytes is not a whole number of {dtype.name} elements")
        self.endpoints = endpoints
        self.rank = rank
        self.world_size = world_size
        self.round = round_no
        self.ticket = round_no if ticket is None else ticket
        self.epoch = epoch
        self._uses = SlotUses() if uses is None else uses
        self.dtype = dtype
        self.op = op
        self.nbytes = nbytes
        self.segment_bytes = segment_bytes
        self.segments = -(-nbytes // segment_bytes)
        self._rtt = rtt
        self._deadline = now + rtt.timing.deadline
        self._started = now
        n = self.segments
        self._sent_at = [0.0] * n
        self._rto = [0.0] * n
        self._timer = [0.0] * n  # retransmission time of an outstanding segment
        self._retransmitted = bytearray(n)
        self._done = bytearray(n)
        self._use = [0] * n  # slot use number given at the first transmission
        self.remaining = n
        self._timers: list[tuple[float, int]] = []
        e = len(endpoints)
        self._ready: deque[int] = deque(
            k for k in range(n) if k // e < endpoints[k % e].slots
        )
        self._pending: dict[int, tuple[int, bytes]] = {}  # endpoint -> (arrived count, bitmap)
        self._aborted_by: str | None = None
        self.retransmissions = 0

    # ---- geometry ----
    def offset(self, k: int) -> int:
        return k * self.segment_bytes

    def length(self, k: int) -> int:
        return min(self.segment_bytes, self.nbytes - k * self.segment_bytes)

    def _header(self, k: int, retransmit: bool) -> Header:
        e = k % len(self.endpoints)
        ep = self.endpoints[e]
        slot = ep.slot_base + (k // len(self.endpoints)) % ep.slots
        if not retransmit:
            self._use[k] = self._uses.take(e, slot)
        return Header(
            Kind.CONTRIBUTION, self.dtype, self.op,
            Flags.RETRANSMIT if retransmit else Flags.NONE, ep.job_id, self.rank, ep.cookie,
            self.round, slot, self.offset(k), self.length(k), self._use[k], self.epoch,
        )

    @property
    def stored_any(self) -> bool:
        """Has any result been written into the caller's array yet?"""
        return self.remaining < self.segments

    # ---- what to send ----
    @property
    def done(self) -> bool:
        return self.remaining == 0

    def due(self, now: float) -> list[Transmit]:
        """Segments to transmit now: newly released ones and expired retransmission timers."""
        self.check(now)
        out: list[Transmit] = []
        timers = self._timers
        while timers and timers[0][0] <= now:
            when, k = heapq.heappop(timers)
            if self._done[k] or when != self._timer[k]:
                continue  # answered, or superseded by a later timer
            self._retransmitted[k] = 1
            self.retransmissions += 1
            self._rtt.timed_out()
            self._rto[k] = min(max(self._rto[k] * 2, self._rtt.rto), self._rtt.timing.rto_max)
            self._arm(k, now)
            out.append(Transmit(k % len(self.endpoints), k, self._header(k, True), self.ticket))
        rto = self._rtt.rto
        while self._ready:
            k = self._ready.popleft()
            self._sent_at[k] = now
            self._rto[k] = rto
            self._arm(k, now)
            out.append(Transmit(k % len(self.endpoints), k, self._header(k, False),
                                self.ticket))
        return out

    def _arm(self, k: int, now: float) -> None:
        self._timer[k] = when = now + self._rto[k]
        heapq.heappush(self._timers, (when, k))

    def wakeup(self) -> float:
        """The time `due` next has work, unless a result arrives first."""
        if self._ready:
            return 0.0
        while self._timers and self._done[self._timers[0][1]]:
            heapq.heappop(self._timers)
        nxt = self._timers[0][0] if self._timers else self._deadline
        return min(nxt, self._deadline)

    # ---- what comes back ----
    def accept(self, h: Header, source: Address | None = None) -> int | None:
        """The segment whose payload the RESULT `h` carries, if we still want it, else None.
        Given its `source`, only the core the segment went to may have sent it."""
        if (h.kind is not Kind.RESULT or h.round != self.round or h.dtype is not self.dtype
                or h.epoch != self.epoch):
            return None
        k, rest = divmod(h.offset, self.segment_bytes)
        if (rest or k >= self.segments or self._done[k] or h.length != self.length(k)
                or h.use != self._use[k]):
            return None
        ep = self.endpoints[k % len(self.endpoints)]
        if (h.job_id != ep.job_id or h.cookie != ep.cookie
                or (source is not None and source != ep.address)):
            return None
        return k

    def stored(self, k: int, now: float) -> None:
        """The result of segment k is in place: release the slot's next segment."""
        if self._done[k]:
            return
        self._done[k] = 1
        self.remaining -= 1
        if not self._retransmitted[k]:
            self._rtt.sample(now - self._sent_at[k])
        ep = self.endpoints[k % len(self.endpoints)]
        nxt = k + ep.slots * len(self.endpoints)
        if nxt < self.segments:
            self._ready.append(nxt)

    def on_pending(self, h: Header, bitmap: bytes) -> None:
        """The appliance says a segment still waits; remember which ranks it has, for errors."""
        if h.kind is not Kind.PENDING or h.round != self.round:
            return
        k, rest = divmod(h.offset, self.segment_bytes)
        if rest or k >= self.segments:
            return
        arrived = bin(int.from_bytes(bitmap, "little")).count("1")
        self._pending[k % len(self.endpoints)] = (arrived, bytes(bitmap))

    def on_aborted(self, h: Header) -> None:
        """The appliance says the job is gone (operator abort, eviction or shutdown)."""
        if h.kind is not Kind.ABORTED:
            return
        for ep in self.endpoints:
            if h.job_id == ep.job_id and h.cookie == ep.cookie:
                self._aborted_by = ep.name
                return

    # ---- failure ----
    def check(self, now: float) -> None:
        if self._aborted_by is not None and not self.done:
            raise JobAborted(
                f"{self._aborted_by} aborted job {self.endpoints[0].job_id} (an operator abort, "
                f"idle eviction or appliance shutdown) during allreduce round {self.round} of "
                f"rank {self.rank}; {self.remaining} of {self.segments} segments unfinished"
            )
        if now < self._deadline or self.done:
            return
        raise AllreduceTimeout(self.describe_stall(now))

    def describe_stall(self, now: float) -> str:
        waiting: dict[int, int] = {}
        for k in range(self.segments):
            if not self._done[k]:
                e = k % len(self.endpoints)
                waiting[e] = waiting.get(e, 0) + 1
        parts = []
        for e, count in sorted(waiting.items()):
            text = f"{self.endpoints[e].name} ({count} segments unanswered"
            if e in self._pending:
                _, bitmap = self._pending[e]
                have = int.from_bytes(bitmap, "little")
                missing = [r for r in range(self.world_size) if not have >> r & 1]
                text += f"; it still waits for ranks {_ranks(missing)}"
            parts.append(text + ")")
        return (
            f"allreduce round {self.round} of {self.nbytes} bytes ({self.dtype.name}, "
            f"{self.op.name}) by rank {self.rank} missed its {self._rtt.timing.deadline:g} s "
            f"deadline after {now - self._started:.1f} s: {self.remaining} of {self.segments} "
            f"segments unanswered; no answer from " + ", ".join(parts)
        )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:16])
    return f"[{shown}{', ...' if len(ranks) > 16 else ''}]"
