"""The state of a core's slots: one table of copy states, and the objects the aggregator moves.

The states of one slot copy and what moves them (`COPY_TRANSITIONS`; anything else raises)::

    EMPTY    --first contribution of the next use-->  FILLING
    FILLING  --contribution, count < world-------->   FILLING
    FILLING  --last contribution------------------>   COMPLETE   (send the result once)
    COMPLETE --retransmission of the same use----->   COMPLETE   (resend it to that worker)
    FILLING/COMPLETE --the slot's next use-------->   FILLING    (a FILLING one was abandoned)
    any      --new epoch-------------------------->   EMPTY
"""

from __future__ import annotations

from enum import Enum

import numpy as np
from numpy.typing import NDArray

from .reduce import SegmentKernel
from .slots import RxPool
from .spec import Address, JobSpec, JobStats
from .wire import HEADER_SIZE, SILENT_RECORDS, DType, Header, Op, SilentRank, beat_interval

__all__ = ["COPY_TRANSITIONS", "OVERDUE_BEATS", "CopyState", "Event", "JobState", "Slot",
           "SlotCopy", "TimedOutRanks", "move"]

# A rank's heartbeats are overdue this many intervals after its last (dataplane.reach): a lease
# thread late by half an interval (a busy host, the GIL) is common, and costs one REACH.
OVERDUE_BEATS = 1.5


class CopyState(Enum):
    EMPTY = "empty"
    FILLING = "filling"
    COMPLETE = "complete"

    # Members are singletons: hash by identity in C. Enum's own __hash__ is a Python call,
    # and `move` hashes two members per contribution.
    __hash__ = object.__hash__


class Event(Enum):
    START = "start"  # first contribution of the slot's next use
    ADD = "add"  # one more contribution, not the last
    LAST = "last"  # the contribution that makes it whole
    RESET = "reset"  # a new epoch

    __hash__ = object.__hash__  # as CopyState's


COPY_TRANSITIONS: dict[tuple[CopyState, Event], CopyState] = {
    (CopyState.EMPTY, Event.START): CopyState.FILLING,
    (CopyState.FILLING, Event.START): CopyState.FILLING,  # an abandoned use recycled
    (CopyState.COMPLETE, Event.START): CopyState.FILLING,
    (CopyState.FILLING, Event.ADD): CopyState.FILLING,
    (CopyState.FILLING, Event.LAST): CopyState.COMPLETE,
    **{(state, Event.RESET): CopyState.EMPTY for state in CopyState},
}


def move(state: CopyState, event: Event) -> CopyState:
    target = COPY_TRANSITIONS.get((state, event))
    if target is None:  # our bug: the datagram path checks the state before it moves it
        raise AssertionError(f"slot copy {state.value}: {event.value} is not a transition")
    return target


class SlotCopy:
    """One of a slot's two copies."""

    __slots__ = (
        "acc", "acc_n", "arrived", "copy", "count", "dtype", "finished", "header", "heads", "held",
        "kernel", "length", "next_rank", "offset", "op", "out", "result", "round", "serial",
        "slot", "started", "state", "use",
    )

    def __init__(self, slot: int, acc: NDArray[np.float32], out: NDArray[np.uint8],
                 heads: tuple[memoryview, memoryview] | None = None, copy: int = 0) -> None:
        self.slot = slot  # job-relative index, echoed in the result header
        self.copy = copy  # which of the slot's two copies this is (its arena buffers)
        self.acc = acc
        self.acc_n = acc  # acc[:elements of the current segment], sliced once per segment
        self.out = out
        # Where a result's header goes: right before the accumulator (fp32 results) and right
        # before `out` (fp16/bf16), so header and payload are contiguous (SlotArena).
        self.heads = heads or (memoryview(bytearray(HEADER_SIZE)),
                               memoryview(bytearray(HEADER_SIZE)))
        self.header: bytearray | memoryview = self.heads[0]
        self.use = 0  # which use of the slot this copy holds (0: none yet)
        self.serial = 0  # its result's serial (wire.Header.serial), once complete
        self.round = -1
        self.offset = -1
        self.dtype = DType.FLOAT32
        self.op = Op.SUM
        self.kernel: SegmentKernel | None = None
        self.length = 0
        self.arrived = 0  # rank bitmap
        self.count = 0
        self.next_rank = 0  # deterministic mode: ranks [0, next_rank) are summed into acc
        self.held: dict[int, int] = {}  # deterministic mode: rank -> receive buffer index
        self.state = CopyState.EMPTY
        self.started = 0.0  # `now` when the current segment's first contribution came
        self.finished = 0.0  # `now` when its last came and the result left
        self.result: memoryview = memoryview(b"")

    def begin(self, use: int, round_no: int, offset: int, dtype: DType, op: Op,
              kernel: SegmentKernel, length: int, now: float) -> None:
        """Take the slot's next use (its first contribution is about to be folded in)."""
        self.use = use
        self.round = round_no
        self.offset = offset
        self.dtype = dtype
        self.op = op
        self.kernel = kernel
        self.length = length
        self.acc_n = self.acc[: length // dtype.itemsize]
        self.arrived = 0
        self.count = 0
        self.next_rank = 0
        self.state = move(self.state, Event.START)
        self.started = now

    def describe(self) -> str:
        return (f"round {self.round} offset {self.offset} length {self.length} "
                f"{self.dtype.name} {self.op.name}")

    def disagreement(self, h: Header) -> str:
        """Why a contribution `h` to this use does not fit it, as far as the headers tell: the
        same round and offset with another op, dtype or length is the callers' doing (their
        allreduce calls differ); another round is one lost or skipped on some ranks."""
        if (h.round, h.offset) != (self.round, self.offset):
            return "a round was lost or skipped on some ranks, or they made different calls"
        if h.op is not self.op:
            return "the ranks called allreduce with different ops"
        if h.dtype is not self.dtype:
            return "the ranks called allreduce on arrays of different dtypes"
        return "the ranks called allreduce on arrays of different sizes"


class Slot:
    __slots__ = ("copies", "latest")

    def __init__(self, copies: tuple[SlotCopy, SlotCopy]) -> None:
        self.copies = copies
        self.latest = 0


class JobState:
    __slots__ = ("all_ranks", "arena_first", "arena_slots", "beats", "bytes_reduced", "closed",
                 "diverged", "elsewhere", "fence", "fence_heard", "held", "last_activity",
                 "last_beat", "last_data", "last_seen", "lost_to", "missed_from", "next_sequence",
                 "reached", "rounds", "segments_reduced", "serial", "slots", "spec", "timed_out",
                 "told")

    def __init__(self, spec: JobSpec, arena_slots: list[int], slots: list[Slot],
                 now: float) -> None:
        self.spec = spec
        self.last_seen = [now] * spec.world_size  # when each rank last said anything
        self.last_data = [-1.0] * spec.world_size  # ... sent a contribution or a query
        self.last_beat: float | None = None  # the latest HEARTBEAT of any rank
        self.beats = [now] * spec.world_size  # ... of each rank (or when it joined)
        self.arena_slots = arena_slots
        # Where job slot 0 lies in the arena when job slot i lies at arena_first + i (-1 when
        # not): consecutive slots' accumulators are then the rows of one view.
        first = arena_slots[0] if arena_slots else 0
        self.arena_first = first if arena_slots == list(range(first, first + len(slots))) else -1
        self.slots = slots
        self.all_ranks = (1 << spec.world_size) - 1
        self.rounds = 0  # highest round with a finished segment on this core, this epoch
        self.bytes_reduced = 0
        self.segments_reduced = 0
        self.last_activity: float | None = None
        self.held = 0  # receive buffers its out-of-turn contributions hold (<= hold_buffers)
        self.diverged: str | None = None  # why the ranks disagree, until the next epoch
        # Draining (dataplane.fence): the newest round that may still start (0: none may), and
        # when a contribution or query of a round up to it last came
        self.fence: int | None = None
        self.fence_heard = float("-inf")
        self.serial = 0  # the serial this core's next result of the job carries
        # per rank, the send sequence its next first transmission should carry (-1: any;
        # dataplane.gaps)
        self.next_sequence = [-1] * spec.world_size
        # rank -> the other endpoint its datagrams (its cookie and all) last came from: a NAT
        # between the worker and here, which the endpoint it joined with does not show
        self.elsewhere: dict[int, Address] = {}
        # Where the job loses datagrams, by rank and direction: per rank, its contributions
        # found never to have come (numbers skipped: dataplane.gaps), and results it is known
        # to have lost (it heard a later one first: notices.lost_on_the_way). One rank far
        # above the others is its cable, its port or its host.
        self.missed_from = [0] * spec.world_size
        self.lost_to = [0] * spec.world_size
        # dataplane.reach: rank -> (the endpoint whose port its host said is closed, when);
        # and rank -> when this core last sent it a REACH
        self.closed: dict[int, tuple[Address, float]] = {}
        self.reached: dict[int, float] = {}
        self.timed_out = TimedOutRanks()
        # the latest LIVENESS that named ranks: (spec, last words, ranks ended, when, how many
        # silent, the records), answered again for a moment (`liveness`)
        self.told: tuple[JobSpec, list[float], int, float, int, list[SilentRank]] | None = None

    def release_held(self, copy: SlotCopy, pool: RxPool) -> None:
        """Give the receive buffers `copy` holds (deterministic mode) back to `pool`."""
        for index in copy.held.values():
            pool.release(index)
        self.held -= len(copy.held)
        copy.held.clear()

    def empty_slots(self, pool: RxPool) -> None:
        """A new epoch: every slot empty again (`Event.RESET`), its held buffers back in
        `pool`, no round finished and no disagreement."""
        for slot in self.slots:
            slot.latest = 0
            for copy in slot.copies:
                self.release_held(copy, pool)
                copy.state = move(copy.state, Event.RESET)
                copy.use, copy.round, copy.offset = 0, -1, -1
        self.diverged = None
        self.rounds = 0

    def stats(self, now: float) -> JobStats:
        """What this core saw of the job, for status and metrics."""
        waiting = self.awaited()
        silent = {s.rank: s.silent_s for s in self.silent(now, waiting)}
        return JobStats(self.rounds, self.bytes_reduced, self.segments_reduced,
                        self.last_activity, waiting, self.diverged, silent,
                        quiet_s=now - max(self.last_seen),
                        heard={rank: now - seen for rank, seen in enumerate(self.last_seen)
                               if self.spec.endpoints[rank] is not None},
                        elsewhere=dict(self.elsewhere),
                        missed_from={r: n for r, n in enumerate(self.missed_from) if n},
                        lost_to={r: n for r, n in enumerate(self.lost_to) if n},
                        ended=tuple(sorted(self.closed_ranks(now))))

    @property
    def bound(self) -> list[Address]:
        return [a for a in self.spec.endpoints if a is not None]

    def awaited(self) -> dict[int, float]:
        """The ranks a use of one of the job's slots (on this core) still waits for, each with
        when the oldest such use began."""
        waiting: dict[int, float] = {}
        for slot in self.slots:
            copy = slot.copies[slot.latest]
            if copy.state is not CopyState.FILLING:
                continue
            missing = self.all_ranks & ~copy.arrived
            while missing:  # its set bits alone: a slot of a big job waits for few ranks
                low = missing & -missing
                rank = low.bit_length() - 1
                missing ^= low
                waiting[rank] = min(waiting.get(rank, copy.started), copy.started)
        return waiting

    def silent(self, now: float, awaited: dict[int, float] | None = None) -> list[SilentRank]:
        """Joined ranks silent past the liveness timeout, and at once a rank that left, or
        whose process ended (`closed_ranks`), while a use of a slot here still waits for it:
        its contribution will never come (a peer stopped by Ctrl-C once kept every other
        rank's shutdown waiting the timeout out). Not at once where nothing here waits for it:
        its peers may still be taking the results of their last round. A rank that has not
        joined yet is not one of them (workers start at different times): its peers wait for
        it until their deadline, and the timeout then names it as missing. `awaited`:
        `awaited()`, where the caller has it."""
        spec = self.spec
        endpoints, departed, last_seen = spec.endpoints, spec.departed, self.last_seen
        timed_out = self.timed_out.ranks(spec, last_seen, now)
        closed = self.closed_ranks(now) if self.closed else frozenset()
        gone = (departed | closed) & (self.awaited() if awaited is None else awaited).keys() \
            if departed or closed else frozenset()
        return [SilentRank(rank, endpoints[rank], now - last_seen[rank], rank in departed,
                           rank in closed and rank not in departed)
                for rank in sorted(gone.union(timed_out) if gone else timed_out)
                if endpoints[rank] is not None]

    def liveness(self, now: float) -> tuple[int, list[SilentRank]]:
        """A HEARTBEAT's answer: how many ranks are silent, and the most telling
        `SILENT_RECORDS` of them (wire.py): ended, then silent, the longest first, then left.
        With hundreds silent (a rack lost power) each answer cost a walk over them, and the
        ranks still alive heartbeat twice a second each: an answer naming ranks is given
        again for a tenth of a heartbeat interval, unless a rank joined, left or ended or an
        outage rewrote the last words meanwhile (a rank heard since stays named that long)."""
        told = self.told
        if (told is not None and told[0] is self.spec and told[1] is self.last_seen
                and told[2] == len(self.closed)
                and now - told[3] < beat_interval(self.spec.liveness_timeout) / 10):
            return told[4], told[5]
        silent = self.silent(now)
        named = sorted(silent, key=lambda s: (not s.closed, s.left, -s.silent_s, s.rank))
        named = named[:SILENT_RECORDS]
        self.told = (self.spec, self.last_seen, len(self.closed), now, len(silent), named) \
            if silent else None
        return len(silent), named

    def overdue(self, now: float) -> float:
        """Ranks last heard here before this are overdue (`now` - the job's `OVERDUE_BEATS`
        heartbeat intervals): their heartbeats stopped, where they come to this core."""
        return now - OVERDUE_BEATS * beat_interval(self.spec.liveness_timeout)

    def closed_ranks(self, now: float) -> frozenset[int]:
        """Ranks whose process ended, as far as this core can tell: their host said nothing
        listens at their endpoint, they were not heard since (a rank that joined again, from
        another endpoint, is not one), and they are overdue here (where its heartbeats come,
        a forged ICMP message cannot end a rank that heartbeats)."""
        endpoints = self.spec.endpoints
        overdue = self.overdue(now)
        return frozenset(
            rank for rank, (address, when) in self.closed.items()
            if when >= self.last_seen[rank] and self.last_seen[rank] < overdue
            and address in (endpoints[rank], self.elsewhere.get(rank)))


class TimedOutRanks:
    """The bound ranks not heard for the liveness timeout, without a scan of every rank per
    question. Every HEARTBEAT is answered with them (dataplane.upkeep), and a job of 4096
    ranks heartbeats 8192 times a second: a scan of its ranks per answer took a core's whole
    time (benchmarks-journal.md, "A job of a thousand ranks").

    A scan notes the ranks timed out then, and the earliest moment another could time out:
    the oldest of the others' last words plus the timeout (a rank's last word only moves
    forward). Until then an answer looks again at the noted ranks alone (one heard since
    drops out); past it, after a rank joined or left (a new spec), or after an outage
    rewrote the list of last words, it scans again."""

    __slots__ = ("_last_seen", "_ranks", "_spec", "_until", "scans")

    def __init__(self) -> None:
        self._spec: JobSpec | None = None
        self._last_seen: list[float] | None = None
        self._ranks: list[int] = []
        self._until = float("-inf")
        self.scans = 0  # (for tests: how often it looked at every rank)

    def ranks(self, spec: JobSpec, last_seen: list[float], now: float) -> list[int]:
        limit = spec.liveness_timeout
        if spec is self._spec and last_seen is self._last_seen and now <= self._until:
            return [rank for rank in self._ranks if now - last_seen[rank] > limit]
        self.scans += 1
        endpoints = spec.endpoints
        ranks, oldest = [], float("inf")
        for rank, seen in enumerate(last_seen):
            if endpoints[rank] is None:
                continue
            if now - seen > limit:
                ranks.append(rank)
            elif seen < oldest:
                oldest = seen
        self._spec, self._last_seen, self._ranks, self._until = spec, last_seen, ranks, \
            oldest + limit
        return list(ranks)
