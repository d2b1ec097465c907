"""Sans-I/O: several allreduce rounds of one rank in flight at once, over lanes of slots.

A job has S slots on every appliance core. With L lanes, lane l owns slots
[l*S/L, (l+1)*S/L) on each core, and round r (numbered 1, 2, ... in submission order) runs in
lane r mod L. Rounds of different lanes never share a slot, so they overlap on the wire without
the appliance knowing: each slot still sees its tags (round, offset) only grow, which is all the
slot protocol asks. Every rank must put a round in the same lane, so the lane is a function of
the round number alone (never "the first free lane", which depends on timing); a round whose
lane is still busy waits, and so does everything submitted after it, which keeps rounds
starting in submission order on every rank.

The transport submits rounds, asks `due(now)` what to send (each `Transmit` names its round in
its header), offers received headers to `accept`, reports `stored`, and collects each finished
round's outcome from `finished()`: None for success, or the `ReductionError` that ended it
(`AllreduceTimeout`, `JobAborted`). One failed round does not stop the others.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from reduction_appliance.dataplane.errors import ReductionError
from reduction_appliance.dataplane.wire import DType, Header, Kind, Op

from .session import AllreduceRound, Endpoint, RttEstimator, Transmit

__all__ = ["Outcome", "RoundPipeline", "lane_endpoints"]


@dataclass(frozen=True)
class Outcome:
    round: int
    error: ReductionError | None
    retransmissions: int


def lane_endpoints(endpoints: tuple[Endpoint, ...], lanes: int) -> list[tuple[Endpoint, ...]]:
    """Each lane's view of the endpoints: the same cores, a disjoint range of their slots."""
    if lanes < 1:
        raise ReductionError(f"lanes must be at least 1, not {lanes}")
    fewest = min(ep.slots for ep in endpoints)
    if lanes > fewest:
        raise ReductionError(
            f"{lanes} lanes need at least {lanes} slots per appliance core; the job has "
            f"{fewest} (raise jobs.slots in the appliance config, or use fewer lanes)")
    return [
        tuple(replace(ep, slot_base=ep.slot_base + ep.slots * lane // lanes,
                      slots=ep.slots * (lane + 1) // lanes - ep.slots * lane // lanes)
              for ep in endpoints)
        for lane in range(lanes)
    ]


@dataclass(frozen=True)
class _Request:
    round: int
    dtype: DType
    op: Op
    nbytes: int


class RoundPipeline:
    """The rounds of one rank of one job: queued, in flight (at most one per lane), finished."""

    def __init__(self, endpoints: tuple[Endpoint, ...], rank: int, world_size: int,
                 segment_bytes: int, rtt: RttEstimator, lanes: int = 1) -> None:
        if not endpoints:
            raise ReductionError("an allreduce needs at least one appliance endpoint")
        self.endpoints = endpoints
        self.rank = rank
        self.world_size = world_size
        self.segment_bytes = segment_bytes
        self.rtt = rtt
        self.lanes = lanes
        self._lane_endpoints = lane_endpoints(endpoints, lanes)
        self._busy: list[AllreduceRound | None] = [None] * lanes
        self._active: dict[int, AllreduceRound] = {}
        self._queued: deque[_Request] = deque()
        self._finished: list[Outcome] = []
        self._abort: Header | None = None  # the appliance's ABORTED notice, once it came
        self.submitted = 0
        self.most_in_flight = 0  # high-water mark: evidence that rounds really overlapped

    # ---- rounds in ----
    def submit(self, dtype: DType, op: Op, nbytes: int) -> int:
        """Queue a round; returns its number (the same on every rank that submits in the same
        order). It starts at the next `due` once its lane is free."""
        self.submitted += 1
        self._queued.append(_Request(self.submitted, dtype, op, nbytes))
        return self.submitted

    @property
    def idle(self) -> bool:
        return not self._active and not self._queued

    def in_flight(self) -> int:
        return len(self._active)

    def _start_queued(self, now: float) -> None:
        while self._queued:
            req = self._queued[0]
            lane = req.round % self.lanes
            if self._busy[lane] is not None:
                return  # strictly in order: later rounds wait behind this one
            self._queued.popleft()
            try:
                rnd = AllreduceRound(self._lane_endpoints[lane], self.rank, self.world_size,
                                     req.round, req.dtype, req.op, req.nbytes,
                                     self.segment_bytes, self.rtt, now)
            except ReductionError as exc:
                self._finished.append(Outcome(req.round, exc, 0))
                continue
            if self._abort is not None:
                rnd.on_aborted(self._abort)
            self._busy[lane] = rnd
            self._active[req.round] = rnd
            self.most_in_flight = max(self.most_in_flight, len(self._active))

    def _finish(self, rnd: AllreduceRound, error: ReductionError | None) -> None:
        del self._active[rnd.round]
        self._busy[rnd.round % self.lanes] = None
        self._finished.append(Outcome(rnd.round, error, rnd.retransmissions))

    # ---- what to send ----
    def due(self, now: float) -> list[Transmit]:
        """Start what may start; every active round's transmissions (or its failure)."""
        out: list[Transmit] = []
        while True:
            self._start_queued(now)
            failed = False
            for rnd in list(self._active.values()):
                try:
                    out.extend(rnd.due(now))  # asking twice at one instant returns nothing new
                except ReductionError as exc:
                    self._finish(rnd, exc)
                    failed = True
            if not failed:
                return out  # else a lane came free: start the next round and ask again

    def wakeup(self) -> float:
        """When `due` next has work (inf when nothing is in flight or queued)."""
        if self._queued and self._busy[self._queued[0].round % self.lanes] is None:
            return 0.0
        return min((rnd.wakeup() for rnd in self._active.values()), default=float("inf"))

    # ---- what comes back ----
    def accept(self, h: Header) -> tuple[AllreduceRound, int] | None:
        """The round and segment a RESULT carries, if still wanted."""
        rnd = self._active.get(h.round)
        if rnd is None:
            return None
        k = rnd.accept(h)
        return None if k is None else (rnd, k)

    def stored(self, rnd: AllreduceRound, k: int, now: float) -> None:
        rnd.stored(k, now)
        if rnd.done:
            self._finish(rnd, None)

    def on_pending(self, h: Header, bitmap: bytes) -> None:
        rnd = self._active.get(h.round)
        if rnd is not None:
            rnd.on_pending(h, bitmap)

    def on_aborted(self, h: Header) -> None:
        """The job is gone: every round in flight fails at its next `due`, and so does every
        round started later (the appliance will never answer them)."""
        if h.kind is not Kind.ABORTED or not any(
                h.job_id == ep.job_id and h.cookie == ep.cookie for ep in self.endpoints):
            return
        self._abort = h
        for rnd in self._active.values():
            rnd.on_aborted(h)

    def finished(self) -> list[Outcome]:
        """Outcomes of the rounds that ended since the last call."""
        out, self._finished = self._finished, []
        return out

    def fail_all(self, error: ReductionError) -> list[Outcome]:
        """End every queued and active round with `error` (the transport is going away)."""
        for rnd in list(self._active.values()):
            self._finish(rnd, error)
        while self._queued:
            self._finished.append(Outcome(self._queued.popleft().round, error, 0))
        return self.finished()
