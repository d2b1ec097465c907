"""Sans-I/O worker core of one allreduce round: which segments to send when, and what to accept.

The tensor's bytes are cut into segments of `segment_bytes`. Segment k goes to endpoint
k mod E (an appliance core), where it is the m = k div E-th segment and uses slot m mod S.
Self-clocking: the next segment for a slot (k + S*E) is released only when the result of k came
back, which is also what lets the appliance reuse a slot copy safely. Each first transmission
on a slot takes that slot's next use number (`SlotUses`, shared by the rounds of one rank and
counted alike by every rank), which the appliance checks against its window. Results are
accepted only from the core the segment went to, for its use and epoch.

Loss recovery at rack speed: every appliance core has its own round-trip estimate (RFC 6298,
Karn's rule, its gains divided by the segments in flight as RFC 7323 has them for a window's
worth of samples per round trip) with a floor in the rack's time scale (`Timing.rto_min`), and
only the lost segment's own timer backs off: one loss never slows the rest. A gap is repaired
without waiting for a timer when it shows: once results came back for `FAST_RETRANSMIT`
segments sent to the same core after one that is still unanswered, and it has been gone two
smoothed round trips, that one goes again (fast retransmit; the time keeps a segment that is
only late, waiting for a peer's repair, from being asked after). A lost segment holds only
its own slot: the other slots keep the pipe full.
What an expired timer does (wait its turn, let one query speak for a stalled core, or ask now
with a backed-off timeout) is decided in plugin/expiry.py from what the core said lately.
First transmissions carry their send sequence to the core (`SendOrder`); a core that sees it
jump says which never came (MISSING, `missing`), and they go again at once.

The transport asks `due(now)` what to send (or `due_packed(now)`: the same, each header in wire
bytes, first transmissions' from the round's packed block: plugin/firsts.py), offers each
received RESULT header to `accept`, and reports `stored` once the payload sits in the output
array (or hands a coalesced receive's results to `take_results` at once: plugin/answers.py).
Nothing here touches a socket or a clock: time is passed in, so tests run thousands of lossy
rounds in milliseconds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque

from reduction_appliance.dataplane.errors import AllreduceTimeout, JobAborted, ReductionError
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    SERIAL_AT,
    SERIALS,
    WRAP,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    pack_into,
)

from .answers import RoundAnswers
from .congestion import CongestionWindow, admit, any_admitted
from .expiry import STALL_SHARE, CoreSigns, Expiry
from .firsts import FLAGS_AT, USE, USE_AT, first_headers
from .overtaken import FAST_RETRANSMIT, REORDER_SHARE, Overtaking
from .rtt import RttEstimator
from .serials import ResultSerials
from .slotplan import (
    Address,
    Endpoint,
    Packed,
    Repairs,
    SendOrder,
    SlotUses,
    Transmit,
    transmit_of,
)
from .stall import stall_report, stalled_cores

__all__ = ["FAST_RETRANSMIT", "REORDER_SHARE", "Address", "AllreduceRound", "Endpoint", "Packed",
           "Repairs", "SendOrder", "SlotUses", "Transmit"]

_new_tuple = tuple.__new__  # a NamedTuple built without its keyword-capable __new__
_NUMBER = [bytes((n,)) for n in range(SERIALS)]  # a QUERY's payload, made once


class AllreduceRound(RoundAnswers, Overtaking):
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
        order: SendOrder | None = None,
        epoch: int = 1,
        ticket: int | None = None,
        in_flight: list[int] | None = None,
        serials: ResultSerials | None = None,
        window: CongestionWindow | None = None,
        late: bool = False,
    ) -> None:
        """`late`: this rank starts the round late by a repair of its own (the previous
        round's last result was resent to it alone): its first burst says so (REPAIRED),
        so that no peer takes a round trip that waited for it as a sample of the path."""
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
        self._order = SendOrder(len(endpoints)) if order is None else order
        self.dtype = dtype
        self.op = op
        self.nbytes = nbytes
        self.segment_bytes = segment_bytes
        self.segments = -(-nbytes // segment_bytes)
        self._rtt = rtt
        # No result for this long fails the round (`check`): a round still making progress
        # goes on however long it takes (a 28 GB tensor over a 1 Gbit/s link: minutes).
        self._deadline = now + rtt.timing.deadline
        self._result_at = now  # the latest result taken (the start until one is)
        self._started = now
        n = self.segments
        self._sent_at = [0.0] * n  # first transmission (RTT samples)
        self._last_sent = [0.0] * n  # latest transmission
        self._signs = CoreSigns(len(endpoints))  # what each core said lately (`due`'s timers)
        self._rto = [0.0] * n
        self._timer = [0.0] * n  # retransmission time of an outstanding segment
        self._retransmitted = bytearray(n)
        self._timed_out = bytearray(n)  # its timer ran out while a stall query spoke for it
        self._done = bytearray(n)
        self._use = [0] * n  # slot use number given at the first transmission
        # Fast retransmit, per endpoint: the order first transmissions left in, the highest of
        # those answered, and the candidates: unanswered segments not yet fast-retransmitted,
        # oldest first. A dict, so that an answer or a repair removes its segment wherever it
        # stands: behind a hole, a queue kept every answered segment until the hole closed,
        # and each turn's scan walked them all.
        self._seq = [0] * n
        self._sent_seq = [0] * len(endpoints)
        self._acked_seq = [0] * len(endpoints)
        self._unanswered: list[dict[int, None]] = [{} for _ in endpoints]
        # ... and those of them asked after at once for a result lost on its way (`_overtaken`)
        self._for_lost: list[dict[int, None]] = [{} for _ in endpoints]
        # Sent and unanswered, per core: how many RTT samples a round trip brings. Rounds in
        # flight together (the lanes of pipeline.py) share one estimator, so they share these
        # counts too (`in_flight`); `_mine` is this round's part of them, for `release`.
        self._in_flight = [0] * len(endpoints) if in_flight is None else in_flight
        self._mine = [0] * len(endpoints)
        # The result serials heard from each core, shared like `in_flight`: the newest (a
        # query carries it) and the ones skipped (plugin/serials.py).
        self._serials = ResultSerials(len(endpoints)) if serials is None else serials
        # The congestion window per core, shared like `in_flight` (plugin/congestion.py), and
        # this round's lowest unanswered segment to each core, which goes whatever the window.
        self._window = window
        self._lowest = list(range(len(endpoints)))
        # What our contributions say of the path (wire.Flags.QUEUED): the window's own measure.
        self._measured = window.measured if window is not None else [False] * len(endpoints)
        self._late = int(Flags.REPAIRED) if late else 0  # the first burst's mark (`late`)
        self.ended_late = False
        # Retransmissions are QUERYs (48 bytes: "the result, or say what you lack") until the
        # appliance says our contribution never came; then, once, the payload.
        self._payload_sent = [0.0] * n
        self._lacks_ours = bytearray(n)
        self._nudged: deque[int] = deque()  # a PENDING or MISSING said ours never came: resend now
        self.fast_retransmissions = 0
        self.nudged_retransmissions = 0  # resent because a PENDING or MISSING said ours never came
        self.queries = 0  # retransmissions that were QUERYs (header only)
        self.remaining = n
        # The armed timers, a heap of (when, tag, segments): a first transmission's timer
        # joins the entry of the segments that left to its core in the same call (they share
        # `when`), so a turn's first transmissions cost one heap push per core, not one each.
        # An entry is live while one of its segments is unanswered with that timer; `_timer`
        # says which timer a segment has now (a later one supersedes it).
        self._timers: list[tuple[float, int, list[int]]] = []
        self._tags = itertools.count()  # (entries of equal `when` never compare their lists)
        e = len(endpoints)
        self._ready: deque[int] = deque(
            k for k in range(n) if k // e < endpoints[k % e].slots
        )
        self._pending: dict[int, tuple[int, bytes]] = {}  # endpoint -> (arrived count, bitmap)
        self._aborted_by: str | None = None
        self._abort_reason = ""
        self.retransmissions = 0
        # Every first transmission's header, packed now but for what is decided as it leaves
        # (plugin/firsts.py); each leaves as a view of its own 48 bytes.
        self._firsts = first_headers(endpoints, rank, round_no, epoch, dtype, op, nbytes,
                                     segment_bytes)
        self._firsts_view = memoryview(self._firsts)

    # ---- geometry ----
    def offset(self, k: int) -> int:
        return k * self.segment_bytes

    def length(self, k: int) -> int:
        return min(self.segment_bytes, self.nbytes - k * self.segment_bytes)

    def _repeat_header(self, k: int, probe: bool) -> Header:
        """The header of segment k sent again: a QUERY (a PROBE if `probe`), or the
        contribution itself once the appliance said ours never came; its first transmission's
        slot and use. (`due` builds first transmissions' headers in line.)"""
        n_ep = len(self.endpoints)
        ep = self.endpoints[k % n_ep]
        slot = ep.slot_base + (k // n_ep) % ep.slots
        offset = k * self.segment_bytes
        query = not self._lacks_ours[k]
        flags = Flags.RETRANSMIT | Flags.SENT if query else Flags.RETRANSMIT
        if not query and self._measured[k % n_ep]:
            flags |= Flags.QUEUED  # our own measure of the path (plugin/congestion.py)
        serial = self._serials.newest[k % n_ep] if query else -1
        if query and probe:
            flags |= Flags.PROBE
        if serial >= 0:
            flags |= Flags.SERIAL
        return Header(
            Kind.QUERY if query else Kind.CONTRIBUTION, self.dtype, self.op, flags,
            ep.job_id, self.rank, ep.cookie, self.round, slot, offset,
            min(self.segment_bytes, self.nbytes - offset), self._use[k], self.epoch,
            max(serial, 0),
        )

    @property
    def repairs(self) -> Repairs:
        """This round's retransmissions, by what sent each one."""
        told, overtaken = self.nudged_retransmissions, self.fast_retransmissions
        return Repairs(overtaken, told, self.retransmissions - overtaken - told, self.queries)

    @property
    def stored_any(self) -> bool:
        """Has any result been written into the caller's array yet?"""
        return self.remaining < self.segments

    # ---- what to send ----
    @property
    def done(self) -> bool:
        return self.remaining == 0

    def due(self, now: float) -> list[Transmit]:
        """Segments to transmit now: presumed lost ones (fast retransmit), expired timers,
        newly released ones."""
        return [transmit_of(p) for p in self.due_packed(now)]

    def due_packed(self, now: float) -> list[Packed]:
        """`due`, each header in wire bytes (the send path's form: no header decoded)."""
        self.check(now)
        out: list[Packed] = []
        n_ep = len(self.endpoints)
        while self._nudged:
            k = self._nudged.popleft()
            if not self._done[k]:
                self.nudged_retransmissions += 1
                self._resend(k, now, out)
        for k, presumed_lost, for_lost in self._overtaken():
            if now >= presumed_lost:
                e = k % n_ep
                del self._unanswered[e][k]
                if for_lost:
                    self._for_lost[e][k] = None
                self.fast_retransmissions += 1
                self._resend(k, now, out)
        timers, done, timer = self._timers, self._done, self._timer
        signs, timing = self._signs, self._rtt.timing
        expired: list[tuple[float, int]] = []
        while timers and timers[0][0] <= now:
            when, _, ran_out = heapq.heappop(timers)
            expired.extend((when, k) for k in ran_out)
        expired.sort()  # (in timer order, and segment order among equal ones)
        for when, k in expired:
            if done[k] or when != timer[k]:
                continue  # answered, or superseded by a later timer
            e = k % n_ep
            verdict = signs.on_expiry(
                e, now, stall=self._clean() and self._acked_seq[e] < self._seq[k],
                crowded=self._mine[e] * STALL_SHARE > self.endpoints[e].slots,
                last_sent=self._last_sent[k], timeout=self._rto[k], rto=self._rtt.rto(e),
                in_flight=self._in_flight[e], timing=timing)
            if verdict.expiry is Expiry.ASK:
                self._rto[k] = verdict.at
                self._resend(k, now, out, probe=verdict.probe)
                continue
            if verdict.expiry is Expiry.DEFER:
                # Its answer, however late, is no round-trip sample (a late rank's wait, not
                # the path's; Karn's rule, as for a resend).
                self._timed_out[k] = 1
            timer[k] = verdict.at
            heapq.heappush(timers, (verdict.at, next(self._tags), [k]))
        ready = self._ready
        if not ready:
            return out
        window = self._window
        if window is not None and window.shrunk:  # a queue stood on the path: lowest first
            ready = admit(ready, n_ep, self._in_flight, window.limit, self._lowest)
        # First transmissions: the per-segment work of a fast link, so the timer is armed in
        # line and each core's RTO is worked out once per call, not once per segment.
        rto_of = [self._rtt.rto(e) for e in range(n_ep)]
        sent_at, rto, timer, last_sent = self._sent_at, self._rto, self._timer, self._last_sent
        sent_seq, seq, unanswered = self._sent_seq, self._seq, self._unanswered
        in_flight, mine = self._in_flight, self._mine
        ticket, push, tags = self.ticket, heapq.heappush, self._tags
        armed_now: list[list[int] | None] = [None] * n_ep  # this call's timer entry per core
        # A first transmission's header was packed with the round (plugin/firsts.py): here
        # it gets what is decided as it leaves, its use, send sequence and QUEUED flag.
        endpoints, uses, use = self.endpoints, self._uses.counts, self._use
        numbers, numbered = self._order.next, self._order.sent
        firsts, firsts_view, pack_use = self._firsts, self._firsts_view, USE.pack_into
        flags_of = [(int(Flags.QUEUED) if queued else 0) | self._late for queued in self._measured]
        self._late = 0  # later first transmissions are clocked by results, not late
        while ready:
            k = ready.popleft()
            e = k % n_ep
            ep = endpoints[e]
            key = e << 32 | (ep.slot_base + (k // n_ep) % ep.slots)  # SlotUses.counts key, in line
            use[k] = this_use = uses[key] = uses.get(key, 0) % WRAP + 1  # wire.next_number
            number = numbers[e]
            numbers[e] = (number + 1) % SERIALS
            numbered[e][number] = (self, k)
            at = k * HEADER_SIZE
            firsts[at + FLAGS_AT] = flags_of[e]
            firsts[at + SERIAL_AT] = number
            pack_use(firsts, at + USE_AT, this_use)
            sent_at[k] = last_sent[k] = self._payload_sent[k] = now
            rto[k] = rto_of[e]
            timer[k] = now + rto_of[e]
            armed = armed_now[e]
            if armed is None:
                armed = armed_now[e] = []
                push(timers, (timer[k], next(tags), armed))
            armed.append(k)
            sent_seq[e] += 1
            in_flight[e] += 1
            mine[e] += 1
            seq[k] = sent_seq[e]
            unanswered[e][k] = None
            out.append(_new_tuple(Packed, (e, k, firsts_view[at:at + HEADER_SIZE], ticket,
                                           None)))
        return out

    def _clean(self) -> bool:
        """Has this round repaired no loss yet (no fast retransmission, no nudged resend)?"""
        return not self.fast_retransmissions and not self.nudged_retransmissions

    def _resend(self, k: int, now: float, out: list[Packed], probe: bool = False) -> None:
        self._retransmitted[k] = 1
        self.retransmissions += 1
        self._arm(k, now)
        header = self._repeat_header(k, probe)
        e = k % len(self.endpoints)
        note: bytes | None = None
        if header.kind is Kind.QUERY:
            self.queries += 1
            note = _NUMBER[(self._order.next[e] - 1) % SERIALS]  # (SENT) our newest to the core
        else:
            self._payload_sent[k] = now
            self._lacks_ours[k] = 0
        packed = bytearray(HEADER_SIZE)
        pack_into(packed, header)
        out.append(Packed(e, k, packed, self.ticket, note))

    def _arm(self, k: int, now: float) -> None:
        self._last_sent[k] = now
        self._timer[k] = when = now + self._rto[k]
        heapq.heappush(self._timers, (when, next(self._tags), [k]))

    def wakeup(self) -> float:
        """The time `due` next has work, unless a result arrives first (ready segments that
        the congestion window holds wait for a result to make room, not for a time)."""
        window, ready = self._window, self._ready
        if self._nudged or (ready and (window is None or not window.shrunk
                                       or self._admits_any(window.limit))):
            return 0.0
        soonest = min(self.next_timer(), self._deadline)
        for _, at, _ in self._overtaken():  # (none, on a clean network: asked every turn)
            if at < soonest:
                soonest = at
        return soonest

    def _admits_any(self, limit: list[int]) -> bool:
        """Would the shrunk window let any ready segment go now (`any_admitted`)? While it
        is full, the usual answer of every turn, only a core's lowest unanswered segment may,
        and it waits in `ready` exactly when it was never sent: its slot's previous use, a
        lower segment, was answered, which released it. So no loop over all that wait."""
        n_ep, in_flight = len(self.endpoints), self._in_flight
        if any(in_flight[e] < limit[e] for e in range(n_ep)):
            return any_admitted(self._ready, n_ep, in_flight, limit, self._lowest)
        return any(low < self.segments and not self._use[low] for low in self._lowest)

    def next_timer(self) -> float:
        """When the earliest live retransmission timer expires (inf: none is armed)."""
        timers, done, timer = self._timers, self._done, self._timer
        while timers:
            when, _, armed = timers[0]
            for i, k in enumerate(armed):
                if not done[k] and timer[k] == when:
                    if i:
                        del armed[:i]  # answered, or superseded: not scanned again
                    return when
            heapq.heappop(timers)  # every segment in it answered, or superseded
        return math.inf

    # ---- what comes back (accept, stored, take_results: plugin/answers.py) ----
    def release(self) -> None:
        """The round is over, answered or not: its unanswered segments leave the shared
        in-flight counts."""
        for e, count in enumerate(self._mine):
            self._in_flight[e] -= count
            self._mine[e] = 0

    def on_pending(self, h: Header, bitmap: bytes, now: float,
                   source: Address | None = None) -> None:
        """The appliance says a segment still waits, and which ranks it has (remembered for a
        timeout's error message). Ours not among them: resend the payload now. When the PENDING
        answers our own query, that is certain (the query left after the payload, on the same
        path); when a peer's query caused it, ours may still be on its way, so only if it left
        longer than a round trip ago."""
        if h.kind is not Kind.PENDING or h.round != self.round or h.epoch != self.epoch:
            return
        k, rest = divmod(h.offset, self.segment_bytes)
        if rest or k >= self.segments:
            return
        e = k % len(self.endpoints)
        if source is not None and source != self.endpoints[e].address:
            return
        have = int.from_bytes(bitmap, "little")
        self._signs.heard_at[e] = self._signs.pending_at[e] = now
        self._pending[e] = (have.bit_count(), bytes(bitmap))
        if self._done[k] or h.use != self._use[k]:
            return
        if have >> self.rank & 1 or self._lacks_ours[k]:
            return
        # A result's round trip includes the wait for the slowest rank: a generous bound on
        # how long our payload may still be on its way.
        in_flight = self._rtt.srtt(e) or self._rtt.timing.rto_initial
        if h.rank == self.rank or now - self._payload_sent[k] >= in_flight:
            self.missing(k)

    def missing(self, k: int) -> None:
        """Our payload of segment k never came (a MISSING named its first transmission, or a
        PENDING said so): resend it now, unless it is answered or already being resent."""
        if not self._done[k] and not self._lacks_ours[k]:
            self._lacks_ours[k] = 1
            self._nudged.append(k)

    def on_aborted(self, h: Header, reason: str = "") -> None:
        """The appliance says the job is gone (operator abort, eviction or shutdown), and
        `reason` why (an appliance of an older release says nothing)."""
        if h.kind is not Kind.ABORTED:
            return
        for ep in self.endpoints:
            if h.job_id == ep.job_id and h.cookie == ep.cookie:
                self._aborted_by = ep.name
                self._abort_reason = reason
                return

    # ---- failure ----
    def check(self, now: float) -> None:
        if self._aborted_by is not None and not self.done:
            why = self._abort_reason or "an operator abort, idle eviction or appliance shutdown"
            # (Of the array this round was given: staged on hosts, a leader's holds its host's
            # sum already, summed by Gloo before this round began.)
            untouched = ("none of its results had come, so the appliance wrote nothing into "
                         "the array it was given" if self.remaining == self.segments else
                         f"{self.remaining} of {self.segments} segments unfinished")
            raise JobAborted(
                f"{self._aborted_by} aborted job {self.endpoints[0].job_id} ({why}) during "
                f"allreduce round {self.round} of rank {self.rank}; {untouched}"
            )
        if now < self._deadline or self.done:
            return
        self._deadline = self._result_at + self._rtt.timing.deadline  # moved on by results
        if now < self._deadline:
            return
        raise AllreduceTimeout(self.describe_stall(now))

    @property
    def result_at(self) -> float:
        """When the latest result was taken (the round's start until one was)."""
        return self._result_at

    def describe_stall(self, now: float) -> str:
        cores = stalled_cores([ep.name for ep in self.endpoints], self._done,
                              {e: bitmap for e, (_, bitmap) in self._pending.items()},
                              self.world_size)
        return stall_report(
            f"allreduce round {self.round} of {self.nbytes} bytes ({self.dtype.name}, "
            f"{self.op.name}) by rank {self.rank}", self._rtt.timing.deadline,
            now - self._started, self.remaining, self.segments, cores)
