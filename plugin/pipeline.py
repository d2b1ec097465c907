"""Sans-I/O: several allreduce rounds of one rank in flight at once, over lanes of slots.

A job has S slots on every appliance core. With L lanes, lane l owns slots
[l*S/L, (l+1)*S/L) on each core, and round r (numbered 1, 2, ... in the order rounds start
within an epoch) runs in lane r mod L. Rounds of different lanes never share a slot, so they
overlap on the wire without the appliance knowing: each slot still sees its uses in order, which
is all the slot protocol asks. Every rank must put a round in the same lane, so the lane is a
function of the round number alone (never "the first free lane", which depends on timing); a
round whose lane is still busy waits, and so does everything submitted after it, which keeps
rounds starting in submission order on every rank.

Liveness: the transport offers the LIVENESS answers to its heartbeats (`on_liveness`) and says
when it last heard from each appliance (`heard`). A fresh answer that names a silent rank fails
every round in flight at once with `RankSilent` (and rounds started while the rank stays
silent; `RankLeft` where the rank left the job); an appliance that has sent nothing for the
liveness timeout while a round needs it fails that round with `ApplianceSilent`. Both name
who, where, and for how long.

A caller knows a round by its ticket (`submit` returns it), which never changes; the round's
number on the wire counts from the start of the job's epoch. When the appliance announces a new
epoch (a rank re-joined: RESYNC), every slot starts over: a round that has not yet received any
result starts again in the new epoch, transparently; one that has cannot (its array is partly
overwritten) and fails with `JobResynchronised`. When the appliance says the ranks diverged
(DIVERGED), every round fails with `JobDiverged` until a new epoch.

The transport submits rounds, asks `due(now)` what to send (each `Transmit` names its ticket),
offers received headers to `accept`, reports `stored`, and collects each finished round's
outcome from `finished()`: None for success, or the `ReductionError` that ended it. One failed
round does not stop the others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from reduction_appliance.dataplane.errors import (
    ApplianceSilent,
    JobDiverged,
    JobResynchronised,
    RankSilent,
    ReductionError,
)
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    SilentRank,
    peek_round,
    silent_in_all,
)

from .congestion import Congestion, CongestionWindow
from .hearing import Hearing
from .rtt import RttEstimator
from .serials import ResultSerials
from .session import (
    Address,
    AllreduceRound,
    Endpoint,
    Packed,
    Repairs,
    SendOrder,
    SlotUses,
    Transmit,
)
from .slotplan import lane_endpoints, transmit_of, wire_round
from .stall import rank_verdict

__all__ = ["Outcome", "RoundPipeline", "lane_endpoints"]

NO_REPAIRS = Repairs()


@dataclass(frozen=True)
class Outcome:
    ticket: int
    error: ReductionError | None
    repairs: Repairs = NO_REPAIRS  # the round's retransmissions, by what sent each one

    @property
    def retransmissions(self) -> int:
        return self.repairs.total


@dataclass(frozen=True)
class _Request:
    ticket: int
    dtype: DType
    op: Op
    nbytes: int


class RoundPipeline:
    """The rounds of one rank of one job: queued, in flight (at most one per lane), finished."""

    def __init__(self, endpoints: tuple[Endpoint, ...], rank: int, world_size: int,
                 segment_bytes: int, rtt: RttEstimator, lanes: int = 1, epoch: int = 1,
                 liveness_timeout: float = float("inf"),
                 congestion: Congestion | None = None,
                 window_cap: int | None = None) -> None:
        if not endpoints:
            raise ReductionError("an allreduce needs at least one appliance endpoint")
        self.endpoints = endpoints
        self.rank = rank
        self.world_size = world_size
        self.segment_bytes = segment_bytes
        self.rtt = rtt
        self.lanes = lanes
        self.epoch = epoch
        self.uses = SlotUses()
        self._lane_endpoints = lane_endpoints(endpoints, lanes)
        # Segments one round may have on the wire at once: its lane's slots on every core (the
        # narrowest lane's, where the slots do not divide evenly).
        self.lane_window = min(sum(ep.slots for ep in lane) for lane in self._lane_endpoints)
        self._busy: list[AllreduceRound | None] = [None] * lanes
        self._in_flight = [0] * len(endpoints)  # per core, over every active round
        # ... and how many it may be (plugin/congestion.py): at most the core's slots, the
        # job's whole window, and `window_cap` (what this worker's receive buffer holds)
        self.window: CongestionWindow | None = None
        slots = [ep.slots for ep in endpoints]
        ceilings = [min(n, window_cap or n) for n in slots]
        if congestion is not None and congestion.enabled:
            self.window = CongestionWindow(ceilings, congestion, slots)
        elif ceilings != slots:  # fixed windows, but held below the slots
            self.window = CongestionWindow(ceilings, Congestion(enabled=False), slots)
        self._serials = ResultSerials(len(endpoints))  # the results heard from each core
        self.order = SendOrder(len(endpoints))  # first transmissions' numbers, every round's
        self._core_at = {ep.address: e for e, ep in enumerate(endpoints)}
        self._active: dict[int, AllreduceRound] = {}  # wire round number -> round
        self._requests: dict[int, _Request] = {}  # ticket -> what was asked, while active
        self._queued: deque[_Request] = deque()
        self._late = False  # the last round to end ended late (AllreduceRound's `late`)
        self._finished: list[Outcome] = []
        # the appliance's ABORTED notice and its reason, once it came
        self._abort: tuple[Header, str] | None = None
        self._diverged: str | None = None  # the appliance's DIVERGED reason, this epoch
        # The next round to start, counted from 1 this epoch; its lane is this count mod
        # lanes, and its number on the wire `wire_round` of it.
        self._next_round = 1
        self.liveness_timeout = liveness_timeout
        # when each appliance last sent us anything, and this rank's heartbeats
        self.hearing = Hearing(max(ep.appliance for ep in endpoints) + 1, liveness_timeout)
        self._heard = self.hearing.heard_at  # (written per datagram: `heard`)
        self._silent_ranks: dict[int, RankSilent] = {}  # appliance -> why a rank is dead
        self._silent_appliances: dict[int, str] = {}  # appliance -> why we think it is dead
        #: appliances to ask about (`take_overdue`)
        self.overdue: list[tuple[int, float]] = []
        self._broken: ReductionError | None = None  # fails every round from now on
        #: the first error a round of this job failed with (the job's failure: its peers meet
        #: it too, and the appliance's status keeps what explains it)
        self.failed_by: ReductionError | None = None
        self.heartbeat_seq = 0  # the newest HEARTBEAT sent; older answers are stale
        self.submitted = 0
        self.most_in_flight = 0  # high-water mark: evidence that rounds really overlapped
        self.rejected = 0  # results and notices refused: wrong source, cookie, use or epoch

    # ---- rounds in ----
    def submit(self, dtype: DType, op: Op, nbytes: int) -> int:
        """Queue a round; returns its ticket. It starts at the next `due` once its lane is
        free, in submission order."""
        self.submitted += 1
        self._queued.append(_Request(self.submitted, dtype, op, nbytes))
        return self.submitted

    def rounds_for(self, nbytes: int) -> int:
        """How many rounds to cut one `nbytes` collective into. A round has only its lane's
        share of the job's slots, so a tensor wider than that window, sent as one round,
        would crawl through a fraction of it (measured on loopback, 16 MiB fp32, 2 ranks:
        4 lanes uncut 47.6 ms, cut 30.6 ms, 1 lane 31.1 ms). Cut into rounds of about a
        window each, up to `lanes` of them, it uses every slot. This matters most for DDP's
        last bucket, on the wire alone while the step waits for it: at 1 Gbit/s with 4 lanes
        of 8 slots, a 0.25 MiB bucket is 30 segments, four round trips as one round. A
        function of the size and the job alone, so every rank cuts alike."""
        segments = -(-nbytes // self.segment_bytes)
        return max(1, min(self.lanes, -(-segments // self.lane_window)))

    @property
    def idle(self) -> bool:
        return not self._active and not self._queued

    def holds_verdicts(self) -> bool:
        """Whether a verdict would fail the next round at its start (a rank or appliance
        silent, the ranks diverged): answers that came since may lift it."""
        return bool(self._silent_ranks or self._silent_appliances or self._diverged)

    def in_flight(self) -> int:
        return len(self._active)

    def quiet_since(self) -> float | None:
        """Since when the rounds in flight have taken no result (None: none in flight)."""
        return max((rnd.result_at for rnd in self._active.values()), default=None)

    def _start_queued(self, now: float) -> None:
        while self._queued:
            lane = self._next_round % self.lanes
            if self._busy[lane] is not None:
                return  # strictly in order: later rounds wait behind this one
            req = self._queued.popleft()
            if self._broken is not None:
                self._finished.append(Outcome(req.ticket, type(self._broken)(str(self._broken))))
                continue
            if self._diverged is not None:
                self._finished.append(Outcome(req.ticket, JobDiverged(self._diverged)))
                continue
            if self._silent_ranks:
                verdict = next(iter(self._silent_ranks.values()))
                self._finished.append(Outcome(req.ticket, type(verdict)(str(verdict))))
                continue
            if self._silent_appliances:  # until it is heard from again
                reason = next(iter(self._silent_appliances.values()))
                self._finished.append(Outcome(req.ticket, ApplianceSilent(reason)))
                continue
            if req.nbytes == 0:  # nothing to reduce, on any rank: done, and off the wire
                # (as a round it would wait for a last result that never comes, until its
                # deadline)
                self._finished.append(Outcome(req.ticket, None))
                continue
            self.hearing.round_starts(now)
            try:
                rnd = AllreduceRound(self._lane_endpoints[lane], self.rank, self.world_size,
                                     wire_round(self._next_round), req.dtype, req.op, req.nbytes,
                                     self.segment_bytes, self.rtt, now, uses=self.uses,
                                     order=self.order,
                                     epoch=self.epoch, ticket=req.ticket,
                                     in_flight=self._in_flight, serials=self._serials,
                                     window=self.window, late=self._late)
            except ReductionError as exc:
                self._finished.append(Outcome(req.ticket, exc))
                continue
            if self._abort is not None:
                rnd.on_aborted(*self._abort)
            self._next_round += 1
            self._busy[lane] = rnd
            self._active[rnd.round] = rnd
            self._requests[req.ticket] = req
            self.most_in_flight = max(self.most_in_flight, len(self._active))

    def _finish(self, rnd: AllreduceRound, error: ReductionError | None) -> None:
        if error is not None and self.failed_by is None:
            self.failed_by = error
        self._late = rnd.ended_late  # the next round starts late by that repair
        self._finish_silently(rnd)
        self._finished.append(Outcome(rnd.ticket, error, rnd.repairs))

    # ---- what to send ----
    def due(self, now: float) -> list[Transmit]:
        """Start what may start; every active round's transmissions (or its failure)."""
        return [transmit_of(p) for p in self.due_packed(now)]

    def due_packed(self, now: float) -> list[Packed]:
        """`due`, each header in wire bytes (the send path's form)."""
        out: list[Packed] = []
        while True:
            self._start_queued(now)
            failed = self._check_appliances(now)
            for rnd in list(self._active.values()):
                try:
                    out.extend(rnd.due_packed(now))  # asking twice at one instant: nothing new
                except ReductionError as exc:
                    self._finish(rnd, exc)
                    failed = True
            if not failed:
                return out  # else a lane came free: start the next round and ask again

    def wakeup(self) -> float:
        """When `due` next has work (inf when nothing is in flight or queued); now when an
        outcome waits to be collected (`finished`)."""
        if self._finished or (self._queued and self._busy[self._next_round % self.lanes] is None):
            return 0.0
        if not self._active:
            return float("inf")
        soonest = self.hearing.wakeup()  # a silence, counted while heartbeats go out
        for rnd in self._active.values():
            at = rnd.wakeup()
            if at < soonest:
                soonest = at
        return soonest

    def timer_expired(self, now: float) -> bool:
        """Has a retransmission timer of a round in flight run out by `now`?"""
        return any(rnd.next_timer() <= now for rnd in self._active.values())

    # ---- liveness ----
    def heard(self, appliance: int, now: float) -> None:
        """A datagram of ours came from one of that appliance's cores."""
        if now > self._heard[appliance]:  # (once per datagram: no max(), no pop() unless needed)
            self._heard[appliance] = now
        if self._silent_appliances:
            self._silent_appliances.pop(appliance, None)

    def beat(self, now: float) -> None:
        """A HEARTBEAT went out (the lease thread): `Hearing.beat`."""
        self.hearing.beat(now)

    def take_overdue(self) -> list[tuple[int, float]]:
        """The appliances found silent long enough, while a round was in flight, to ask
        whether their daemons still run (`Hearing.overdue`), each with how long it had been
        silent; each once per question (`due` finds them)."""
        found, self.overdue = self.overdue, []
        return found

    def _check_appliances(self, now: float) -> bool:
        """Note the appliances overdue; fail the rounds that need an appliance silent past the
        liveness timeout: silent while this rank's heartbeats went out."""
        hearing = self.hearing
        if now >= hearing.look_at and self._active:
            self.overdue += hearing.overdue(now)
        if now - min(self._heard) <= self.liveness_timeout:
            return False  # every appliance spoke lately: the common case, asked every turn
        if not hearing.silences(now, self.liveness_timeout):
            return False
        failed = False
        for rnd in list(self._active.values()):
            for a in {ep.appliance for ep in rnd.endpoints}:
                quiet = hearing.quiet(a, now)
                if quiet > self.liveness_timeout:
                    names = sorted({ep.name for ep in rnd.endpoints if ep.appliance == a})
                    reason = (f"{names[0].rsplit(' core ', 1)[0]} has sent nothing for "
                              f"{quiet:.1f} s (liveness timeout {self.liveness_timeout:g} s) "
                              f"while round {rnd.round} of rank {self.rank} waited on it: it "
                              f"died or the network to it is down ({', '.join(names)})")
                    self._silent_appliances[a] = reason
                    self._finish(rnd, ApplianceSilent(reason))
                    failed = True
                    break
        return failed

    def on_liveness(self, h: Header, silent: list[SilentRank],
                    source: Address | None = None) -> None:
        """An answer to our heartbeat: the ranks the appliance has not heard for too long. Or,
        flagged UNASKED, a core's word that ranks ended which segments it has wait for."""
        unasked = h.flags & Flags.UNASKED
        if (h.kind is not Kind.LIVENESS or not self._ours(h, source) or h.epoch != self.epoch
                or (not unasked and h.round + 2 < self.heartbeat_seq)):  # an old answer
            return
        appliance = next(ep.appliance for ep in self.endpoints
                         if source is None or ep.address == source)
        dead = [s for s in silent if s.rank != self.rank]
        if not dead:
            if not unasked:  # (an unasked word names ranks, and lifts nothing)
                self._silent_ranks.pop(appliance, None)
            return
        verdict = rank_verdict(dead, h.job_id, self.liveness_timeout,
                               unnamed=silent_in_all(h, silent) - len(silent))
        self._silent_ranks[appliance] = verdict
        for rnd in list(self._active.values()):
            self._finish(rnd, verdict)

    # ---- what comes back ----
    def _ours(self, h: Header, source: Address | None) -> bool:
        """A notice from one of our appliance cores about our job."""
        ok = (any(h.job_id == ep.job_id and h.cookie == ep.cookie for ep in self.endpoints)
              and (source is None or source in self._core_at))
        if not ok:
            self.rejected += 1
        return ok

    def accept(self, h: Header, source: Address | None = None
               ) -> tuple[AllreduceRound, int] | None:
        """The round and segment a RESULT carries, if still wanted (and, given its `source`,
        sent by the core that segment went to)."""
        rnd = self._active.get(h.round)
        k = None if rnd is None else rnd.accept(h, source)
        if k is None:
            self.rejected += 1
            return None
        assert rnd is not None
        return rnd, k

    def take_results(self, buf: bytearray, view: memoryview, start: int, nbytes: int,
                     size: int, source: Address, now: float,
                     outputs: Mapping[int, memoryview], arrived: float | None = None) -> int:
        """`AllreduceRound.take_results` for the round the datagram at `start` names (its
        array: `outputs[ticket]`); returns where the first datagram not taken begins."""
        rnd = self._active.get(peek_round(buf, start)) if nbytes - start >= HEADER_SIZE \
            else None
        if rnd is None:
            return start
        at = rnd.take_results(buf, view, start, nbytes, size, source, now, outputs[rnd.ticket],
                             arrived)
        if rnd.done:
            self._finish(rnd, None)
        return at

    def stored(self, rnd: AllreduceRound, k: int, now: float, completer: int = -1,
               flags: int = 0) -> None:
        rnd.stored(k, now, completer, flags)
        if rnd.done:
            self._finish(rnd, None)

    def on_pending(self, h: Header, bitmap: bytes, now: float,
                   source: Address | None = None) -> None:
        rnd = self._active.get(h.round)
        if rnd is not None and self._ours(h, source) and h.epoch == self.epoch:
            rnd.on_pending(h, bitmap, now, source)

    def on_missing(self, h: Header, numbers: bytes, source: Address | None) -> None:
        """A core says first transmissions of ours never came (MISSING: their send numbers):
        the rounds they belong to resend them now."""
        if (h.kind is not Kind.MISSING or h.rank != self.rank or h.epoch != self.epoch
                or not self._ours(h, source)):
            return
        core = self._core_at.get(source) if source is not None else None
        if core is None:
            return
        for rnd, k in self.order.segments(core, numbers):
            if self._active.get(rnd.round) is rnd:
                rnd.missing(k)

    def on_aborted(self, h: Header, source: Address | None = None, reason: str = "") -> None:
        """The job is gone (`reason`: why, as the appliance says it): every round in flight
        fails at its next `due`, and so does every round started later (the appliance will
        never answer them)."""
        if h.kind is not Kind.ABORTED or not self._ours(h, source):
            return
        self._abort = (h, reason)
        for rnd in self._active.values():
            rnd.on_aborted(h, reason)

    def on_diverged(self, h: Header, reason: str, source: Address | None = None) -> None:
        """The appliance saw the ranks disagree: fail every round of this epoch now, and every
        later one until the job is resynchronised (a new epoch)."""
        if h.kind is not Kind.DIVERGED or not self._ours(h, source) or h.epoch != self.epoch:
            return
        self._diverged = reason or "the ranks of this job diverged"
        for rnd in list(self._active.values()):
            self._finish(rnd, JobDiverged(self._diverged))

    def on_resync(self, h: Header, source: Address | None = None) -> None:
        """The job is at epoch `h.epoch` (a rank re-joined, or the ranks resynced)."""
        if h.kind is not Kind.RESYNC or not self._ours(h, source) or h.epoch == self.epoch:
            return
        self.adopt_epoch(h.epoch)

    def adopt_epoch(self, epoch: int) -> None:
        """Start over in `epoch`: uses and round numbers count from the start again; rounds
        with no result yet start again, the others fail with `JobResynchronised`."""
        if epoch == self.epoch:
            return
        self.epoch = epoch
        self.uses.reset()
        self._serials.reset()  # a restarted core numbers its results from 0 again
        self._next_round = 1
        self._diverged = None
        self._silent_ranks.clear()
        restart: list[_Request] = []
        # In submission order: tickets (wire round numbers wrap, so they may not be).
        for rnd in sorted(self._active.values(), key=lambda r: r.ticket):
            if rnd.stored_any:
                self._finish(rnd, JobResynchronised(
                    f"job {rnd.endpoints[0].job_id} was resynchronised to epoch {epoch} (a "
                    "rank re-joined, or an appliance core restarted empty) while round "
                    f"{rnd.round} of rank {self.rank} had {rnd.segments - rnd.remaining} of "
                    f"{rnd.segments} results: that round is lost; the next ones run in the "
                    "new epoch"))
            else:
                restart.append(self._requests[rnd.ticket])
                self._finish_silently(rnd)
        self._queued.extendleft(reversed(restart))

    def _finish_silently(self, rnd: AllreduceRound) -> None:
        rnd.release()
        del self._active[rnd.round]
        del self._requests[rnd.ticket]
        self._busy[self._busy.index(rnd)] = None

    def finished(self) -> list[Outcome]:
        """Outcomes of the rounds that ended since the last call."""
        out, self._finished = self._finished, []
        return out

    def fail_all(self, error: ReductionError, *, for_good: bool = False) -> list[Outcome]:
        """End every queued and active round with `error` (the transport is going away);
        `for_good`: and every round started later (the job cannot go on)."""
        if for_good:
            self._broken = error
        for rnd in list(self._active.values()):
            self._finish(rnd, error)
        while self._queued:
            self._finished.append(Outcome(self._queued.popleft().ticket, error))
        return self.finished()
