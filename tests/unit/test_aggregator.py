"""Aggregator scenarios: values in, decisions out; no sockets, no clock."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.dtypes import by_numpy, info
from reduction_appliance.dataplane.errors import AdmissionError
from reduction_appliance.dataplane.notices import RESULT_IN_FLIGHT_S, RESULT_QUEUED_S
from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import JobSpec
from reduction_appliance.dataplane.transport import Send
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    SilentRank,
    pack_into,
    unpack,
    unpack_silent,
)
from reduction_appliance.deploy.testnet.reference import (
    integer_valued,
    random_values,
    reference,
    same_bits,
)

from .feeding import feed

KERNELS = select_kernels()
GROUP = ("239.255.0.9", 7100)
COOKIE = 0x1234_5678_9ABC_DEF0


@pytest.fixture
def arena() -> Iterator[SlotArena]:
    with SlotArena(capacity=8, max_payload=1024, rx_buffers=32) as a:
        yield a


def where(rank: int) -> tuple[str, int]:
    """The endpoint rank joined from."""
    return (f"198.18.0.{10 + rank}", 9000 + rank)


def spec(world: int = 3, deterministic: bool = False, multicast: bool = True,
         job: int = 5, epoch: int = 1, hold: int | None = None) -> JobSpec:
    """Every rank joined; a deterministic job may hold what one segment can need."""
    held = (world - 1 if hold is None else hold) if deterministic else 0
    return JobSpec(job, COOKIE, world, 2, deterministic, GROUP if multicast else None,
                   epoch=epoch, endpoints=tuple(where(r) for r in range(world)),
                   hold_buffers=held)


def make(arena: SlotArena, world: int = 3, deterministic: bool = False,
         multicast: bool = True) -> Aggregator:
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(world, deterministic, multicast), 0.0)
    return agg


def contribute(agg: Aggregator, rank: int, data: np.ndarray, *, round_no: int = 1,
               slot: int = 0, offset: int = 0, op: Op = Op.SUM, cookie: int = COOKIE,
               job: int = 5, flags: int = 0, dtype: DType | None = None,
               length: int | None = None, use: int = 1, epoch: int = 1,
               source: tuple[str, int] | None = None, now: float = 0.0) -> list[Send]:
    payload = data.reshape(-1).view(np.uint8)
    found = by_numpy(data.dtype)
    dt = dtype or (found.dtype if found else DType.FLOAT32)
    h = Header(Kind.CONTRIBUTION, dt, op, flags, job, rank, cookie, round_no, slot, offset,
               len(payload) if length is None else length, use, epoch)
    header = bytearray(HEADER_SIZE)
    pack_into(header, h)
    return feed(agg, [(bytes(header) + payload.tobytes(), source or where(rank))], now)


def heartbeat_of(rank: int) -> bytes:
    """Rank `rank`'s HEARTBEAT (round 1) for job 5, epoch 1."""
    heartbeat = bytearray(HEADER_SIZE)
    pack_into(heartbeat, Header(Kind.HEARTBEAT, DType.FLOAT32, Op.SUM, 0, 5, rank, COOKIE, 1, 0,
                                0, 0, 0, 1))
    return bytes(heartbeat)


def result_of(sends: list[Send], dtype: np.dtype) -> np.ndarray:
    assert len(sends) == 1
    h = unpack(bytes(sends[0].header))
    assert h.kind is Kind.RESULT
    return np.frombuffer(bytes(sends[0].payload), dtype)


def test_complete_segment_is_multicast_once(arena: SlotArena) -> None:
    agg = make(arena)
    xs = [np.full(16, r + 1, np.float32) for r in range(3)]
    assert contribute(agg, 0, xs[0]) == []
    assert contribute(agg, 1, xs[1]) == []
    sends = contribute(agg, 2, xs[2])
    assert sends[0].dest == GROUP
    assert np.array_equal(result_of(sends, np.float32), np.full(16, 6, np.float32))
    h = unpack(bytes(sends[0].header))
    assert (h.job_id, h.round, h.slot, h.offset, h.length, h.cookie) == (5, 1, 0, 0, 64, COOKIE)
    assert agg.counters[Counter.SEGMENTS_REDUCED] == 1


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("order", [(2, 0, 1), (0, 1, 2), (1, 2, 0)])
def test_a_result_names_the_rank_whose_contribution_completed_it(
        arena: SlotArena, deterministic: bool, order: tuple[int, int, int]) -> None:
    """The congestion windows' delay signal (plugin/congestion.py): only the last rank in
    waited for no peer. In deterministic mode too, where early ranks' datagrams are held."""
    agg = make(arena, deterministic=deterministic)
    sends: list[Send] = []
    for rank in order:
        sends = contribute(agg, rank, np.full(16, rank + 1, np.float32))
    assert len(sends) == 1
    assert unpack(bytes(sends[0].header)).rank == order[-1]
    # A resend of that result (a query after it left) names the same rank.
    query = contribute(agg, order[0], np.full(16, 1, np.float32), flags=Flags.RETRANSMIT,
                       now=1.0)
    assert [unpack(bytes(s.header)).rank for s in query] == [order[-1]]


def test_a_result_echoes_the_queued_flag_of_the_contribution_that_completed_it(
        arena: SlotArena) -> None:
    agg = make(arena)
    one = np.ones(16, np.float32)
    for slot, marks in ((0, (True, False, True)), (1, (True, True, False))):
        sends: list[Send] = []
        for rank, marked in enumerate(marks):
            sends = contribute(agg, rank, one, slot=slot, offset=64 * slot,
                               flags=Flags.QUEUED if marked else 0)
        h = unpack(bytes(sends[0].header))
        assert bool(h.flags & Flags.QUEUED) is marks[-1]


@pytest.mark.parametrize(("last", "repaired"), [
    (0, False),  # a first transmission, on time
    (Flags.RETRANSMIT, True),  # the completing contribution was sent again
    (Flags.REPAIRED, True),  # ... or its sender started the round late by a repair
    (Flags.RETRANSMIT | Flags.QUEUED, True),
])
def test_a_result_completed_by_a_repair_says_so_and_a_resend_is_flagged_for_its_rank(
        arena: SlotArena, last: Flags, repaired: bool) -> None:
    """No rank may take a round trip that waited for a peer's repair as a sample of the path
    (wire.Flags.REPAIRED); a result resent to one rank tells it that it got it after its
    peers (RETRANSMIT on a RESULT), while the multicast copy stays as it was."""
    agg = make(arena)
    one = np.ones(16, np.float32)
    contribute(agg, 0, one, flags=Flags.REPAIRED)  # (an earlier rank's mark counts for nothing)
    contribute(agg, 1, one)
    (result,) = contribute(agg, 2, one, flags=last)
    h = unpack(bytes(result.header))
    assert bool(h.flags & Flags.REPAIRED) is repaired
    assert bool(h.flags & Flags.QUEUED) is bool(last & Flags.QUEUED)
    assert not h.flags & Flags.RETRANSMIT
    (resent,) = contribute(agg, 1, one, flags=Flags.RETRANSMIT, now=1.0)
    again = unpack(bytes(resent.header))
    assert resent.dest == where(1) and again.flags == h.flags | Flags.RETRANSMIT
    assert again._replace(flags=h.flags) == h
    assert unpack(bytes(result.header)) == h  # the stored header is untouched


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_result_header_sits_right_before_its_payload_in_the_arena(
        arena: SlotArena, dtype: type) -> None:
    """RDMA sends header and payload as one scatter entry: they must be contiguous, and inside
    the arena (the registered memory), for fp32 results (the accumulator) and narrowed ones."""
    agg = make(arena)
    for r in range(2):
        contribute(agg, r, np.full(100, r + 1, dtype))
    (send,) = contribute(agg, 2, np.full(100, 3, dtype))
    head = np.frombuffer(send.header, np.uint8).ctypes.data
    body = np.frombuffer(send.payload, np.uint8).ctypes.data
    assert head + HEADER_SIZE == body
    assert arena.address <= head and body + len(send.payload) <= arena.address + arena.nbytes
    assert np.array_equal(result_of([send], np.dtype(dtype)), np.full(100, 6, dtype))


def test_unicast_fallback_sends_to_every_rank(arena: SlotArena) -> None:
    agg = make(arena, multicast=False)
    for r in range(2):
        contribute(agg, r, np.ones(4, np.float32))
    sends = contribute(agg, 2, np.ones(4, np.float32))
    assert sorted(s.dest[1] for s in sends) == [9000, 9001, 9002]


def test_duplicate_never_adds_twice(arena: SlotArena) -> None:
    agg = make(arena)
    contribute(agg, 0, np.ones(8, np.float32))
    assert contribute(agg, 0, np.ones(8, np.float32)) == []
    contribute(agg, 1, np.ones(8, np.float32))
    sends = contribute(agg, 2, np.ones(8, np.float32))
    assert np.array_equal(result_of(sends, np.float32), np.full(8, 3, np.float32))
    assert agg.counters[Counter.DUPLICATES] == 1


def test_retransmission_of_unfinished_segment_gets_pending_bitmap(arena: SlotArena) -> None:
    agg = make(arena, world=4)
    contribute(agg, 0, np.ones(8, np.float32))
    contribute(agg, 2, np.ones(8, np.float32))
    (reply,) = contribute(agg, 2, np.ones(8, np.float32), flags=Flags.RETRANSMIT)
    h = unpack(bytes(reply.header))
    assert h.kind is Kind.PENDING and h.use == 1 and h.epoch == 1
    assert int.from_bytes(bytes(reply.payload), "little") == 0b0101
    stats = agg.stats(5, 0.0)
    assert stats is not None and sorted(stats.waiting) == [1, 3]


def query(agg: Aggregator, rank: int, *, slot: int = 0, length: int = 32, use: int = 1,
          payload: bytes = b"", now: float = 0.0, probe: bool = False,
          seen: int | None = None, offset: int = 0) -> list[Send]:
    """A QUERY: a contribution's header (segment length `length`) and no payload; `seen`: the
    newest result serial its worker claims (Flags.SERIAL)."""
    header = bytearray(HEADER_SIZE)
    flags = Flags.RETRANSMIT | Flags.PROBE if probe else Flags.RETRANSMIT
    if seen is not None:
        flags |= Flags.SERIAL
    pack_into(header, Header(Kind.QUERY, DType.FLOAT32, Op.SUM, flags, 5, rank, COOKIE,
                             1, slot, offset, length, use, 1, seen or 0))
    return feed(agg, [(bytes(header) + payload, where(rank))], now)


def pending_of(send: Send) -> tuple[int, int]:
    """(the rank the PENDING answers, the arrived-rank bitmap)."""
    h = unpack(bytes(send.header))
    assert h.kind is Kind.PENDING
    return h.rank, int.from_bytes(bytes(send.payload), "little")


def test_a_query_gets_pending_then_the_result_and_never_adds(arena: SlotArena) -> None:
    agg = make(arena)
    contribute(agg, 0, np.full(8, 1, np.float32))
    contribute(agg, 1, np.full(8, 2, np.float32))
    (reply,) = query(agg, 0)
    assert reply.dest == where(0) and pending_of(reply) == (0, 0b011)
    sends = contribute(agg, 2, np.full(8, 3, np.float32))
    assert np.array_equal(result_of(sends, np.float32), np.full(8, 6, np.float32))
    (resend,) = query(agg, 1)
    assert resend.dest == where(1) and bytes(resend.payload) == bytes(sends[0].payload)
    assert agg.counters[Counter.QUERIES] == 1 and agg.counters[Counter.RESULTS_RESENT] == 1
    assert agg.counters[Counter.DUPLICATES] == 0
    stats = agg.stats(5, 0.0)  # asked after with no proof of loss: none counted as lost
    assert stats is not None and stats.lost_to == {} and stats.missed_from == {}


def test_a_query_for_a_use_never_begun_says_nothing_came_and_starts_nothing(
        arena: SlotArena) -> None:
    agg = make(arena)
    (reply,) = query(agg, 2)  # its contribution was lost: the slot's use never began here
    assert reply.dest == where(2) and pending_of(reply) == (2, 0)
    for r in range(2):
        assert contribute(agg, r, np.ones(8, np.float32)) == []
    sends = contribute(agg, 2, np.ones(8, np.float32))
    assert np.array_equal(result_of(sends, np.float32), np.full(8, 3, np.float32))


def test_a_probe_for_a_result_just_sent_hears_pending_and_a_later_one_gets_it(
        arena: SlotArena) -> None:
    """A stalled worker's timer probes (Flags.PROBE) while the result it wants left a moment
    ago: it hears "every rank is in" instead of a duplicate. Once the result has been out for
    RESULT_IN_FLIGHT_S, a probe gets it, and a plain query (a hole: later results came) gets it
    at once."""
    agg = make(arena)
    for r in range(3):
        sends = contribute(agg, r, np.full(8, 2, np.float32), now=1.0)
    assert len(sends) == 1  # the multicast result left at t = 1.0
    (held,) = query(agg, 1, probe=True, now=1.0 + RESULT_IN_FLIGHT_S / 2)
    assert held.dest == where(1) and pending_of(held) == (1, 0b111)
    assert agg.counters[Counter.RESULTS_WITHHELD] == 1
    assert agg.counters[Counter.RESULTS_RESENT] == 0
    (plain,) = query(agg, 2, now=1.0 + RESULT_IN_FLIGHT_S / 2)
    (late,) = query(agg, 1, probe=True, now=1.0 + RESULT_IN_FLIGHT_S)
    for resend in (plain, late):
        assert unpack(bytes(resend.header)).kind is Kind.RESULT
        assert bytes(resend.payload) == bytes(sends[0].payload)
    assert agg.counters[Counter.RESULTS_RESENT] == 2
    assert agg.counters[Counter.RESULTS_WITHHELD] == 1


def test_results_are_numbered_and_only_one_older_than_the_newest_seen_is_resent_at_once(
        arena: SlotArena) -> None:
    """Results carry serials in the order the core sends them. A query claiming a newer serial
    than the result's comes from a worker that lost it (results travel one path in order): it
    is resent at once, even a moment after it left. A query claiming an older one comes before
    the result can have arrived: it hears PENDING, for RESULT_IN_FLIGHT_S."""
    agg = make(arena)
    serials = []
    for slot, use, offset in ((0, 1, 0), (1, 1, 32), (0, 2, 64)):  # the job has two slots
        for r in range(3):
            sends = contribute(agg, r, np.full(8, 2, np.float32), slot=slot, use=use,
                               offset=offset, now=1.0)
        serials.append(unpack(bytes(sends[0].header)).serial)
    assert serials == [0, 1, 2]
    soon = 1.0 + RESULT_IN_FLIGHT_S / 2
    (lost,) = query(agg, 0, seen=2, now=soon)  # it has 2, so 0 was lost
    assert unpack(bytes(lost.header)).kind is Kind.RESULT and lost.dest == where(0)
    (early,) = query(agg, 1, use=2, offset=64, seen=1, now=soon)  # 2 is on its way
    assert pending_of(early) == (1, 0b111)
    (later,) = query(agg, 1, use=2, offset=64, seen=1, now=1.0 + RESULT_IN_FLIGHT_S)
    assert unpack(bytes(later.header)).kind is Kind.RESULT
    assert agg.counters[Counter.RESULTS_RESENT] == 2
    assert agg.counters[Counter.RESULTS_WITHHELD] == 1
    # The job's status counts the first as lost on the way to rank 0; the second, resent to
    # rank 1 after a wait with nothing later heard, may have been late or unread: not counted
    stats = agg.stats(5, 2.0)
    assert stats is not None and stats.lost_to == {0: 1}


def test_a_result_queued_behind_another_unheard_one_is_withheld_longer(
        arena: SlotArena) -> None:
    """A query whose newest serial lacks an earlier result than the one it asks after, too,
    comes from a worker whose results are queued on their way (they keep their order on its
    path): the result is withheld for RESULT_QUEUED_S, not RESULT_IN_FLIGHT_S, then resent."""
    agg = make(arena)
    for slot, use, offset in ((0, 1, 0), (1, 1, 32), (0, 2, 64)):  # serials 0, 1, 2
        for r in range(3):
            contribute(agg, r, np.full(8, 2, np.float32), slot=slot, use=use, offset=offset,
                       now=1.0)
    late = 1.0 + RESULT_IN_FLIGHT_S
    (next_one,) = query(agg, 1, use=2, offset=64, seen=1, now=late)  # lacks only 2
    assert unpack(bytes(next_one.header)).kind is Kind.RESULT
    (queued,) = query(agg, 1, use=2, offset=64, seen=0, now=late)  # lacks 1 and 2: a queue
    assert pending_of(queued) == (1, 0b111)
    (held,) = query(agg, 2, use=2, offset=64, seen=0, now=1.0 + RESULT_QUEUED_S * 0.99)
    assert pending_of(held) == (2, 0b111)
    (resent,) = query(agg, 1, use=2, offset=64, seen=0, now=1.0 + RESULT_QUEUED_S)
    assert unpack(bytes(resent.header)).kind is Kind.RESULT
    assert agg.counters[Counter.RESULTS_WITHHELD] == 2
    assert agg.counters[Counter.RESULTS_RESENT] == 2


@pytest.mark.parametrize(("length", "payload"), [(32, b"\0" * 4), (30, b""), (0, b""),
                                                   (4096, b"")])
def test_a_query_with_a_payload_or_an_impossible_length_is_dropped(
        arena: SlotArena, length: int, payload: bytes) -> None:
    agg = make(arena)
    contribute(agg, 0, np.ones(8, np.float32))
    assert query(agg, 0, length=length, payload=payload) == []
    assert agg.counters[Counter.DROP_BAD_LENGTH] == 1


def test_pending_nudges_the_missing_ranks_that_sent_since_the_segment_began(
        arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(world=4), 0.0)
    contribute(agg, 0, np.ones(8, np.float32), slot=0)
    contribute(agg, 2, np.ones(8, np.float32), slot=0)
    # Rank 3 is in this round (its slot-1 segment came after slot 0 began) but its slot-0
    # contribution was lost; rank 1 has sent nothing: still computing.
    contribute(agg, 3, np.ones(8, np.float32), slot=1, offset=32, now=1.0)
    replies = query(agg, 0, now=2.0)
    assert sorted((s.dest, pending_of(s)) for s in replies) == [
        (where(0), (0, 0b0101)), (where(3), (0, 0b0101))]
    assert agg.counters[Counter.PENDING_SENT] == 2

def test_lost_result_is_resent_unicast_from_the_stored_copy(arena: SlotArena) -> None:
    agg = make(arena)
    for r in range(3):
        sends = contribute(agg, r, np.full(8, 2, np.float32))
    # Rank 1 missed the multicast and retransmits: only rank 1 gets the stored result.
    (resend,) = contribute(agg, 1, np.full(8, 2, np.float32), flags=Flags.RETRANSMIT)
    assert resend.dest == ("198.18.0.11", 9001)
    assert bytes(resend.payload) == bytes(sends[0].payload)
    assert agg.counters[Counter.RESULTS_RESENT] == 1


def test_late_retransmission_answered_while_the_other_copy_fills(arena: SlotArena) -> None:
    agg = make(arena, world=2)
    for r in range(2):
        first = contribute(agg, r, np.full(8, 1, np.float32), offset=0)
    stored = bytes(first[0].payload)
    # Rank 0 got the result and moved on to the slot's next segment ...
    contribute(agg, 0, np.full(8, 5, np.float32), offset=4096, use=2)
    # ... while rank 1 lost it and retransmits the old one: answered from the shadow copy.
    (resend,) = contribute(agg, 1, np.full(8, 1, np.float32), offset=0, flags=Flags.RETRANSMIT)
    assert bytes(resend.payload) == stored
    sends = contribute(agg, 1, np.full(8, 5, np.float32), offset=4096, use=2)
    assert np.array_equal(result_of(sends, np.float32), np.full(8, 10, np.float32))


def test_stale_round_is_dropped(arena: SlotArena) -> None:
    agg = make(arena, world=2)
    for r in range(2):
        contribute(agg, r, np.ones(4, np.float32), round_no=1, offset=0)
    for r in range(2):
        contribute(agg, r, np.ones(4, np.float32), round_no=2, offset=0, use=2)
    for r in range(2):
        contribute(agg, r, np.ones(4, np.float32), round_no=3, offset=0, use=3)
    assert contribute(agg, 0, np.ones(4, np.float32), round_no=1, offset=0) == []
    assert agg.counters[Counter.DROP_STALE] == 1


@pytest.mark.parametrize(
    ("kwargs", "counter"),
    [
        ({"cookie": 1}, Counter.DROP_BAD_COOKIE),
        ({"job": 99}, Counter.DROP_UNKNOWN_JOB),
        ({"slot": 2}, Counter.DROP_BAD_SLOT),
        ({"length": 12}, Counter.DROP_BAD_LENGTH),
    ],
)
def test_bad_datagrams_are_counted_and_dropped(arena: SlotArena, kwargs: dict[str, int],
                                               counter: Counter) -> None:
    agg = make(arena, world=1)
    assert contribute(agg, 0, np.ones(4, np.float32), **kwargs) == []
    assert agg.counters[counter] == 1
    assert agg.counters[Counter.SEGMENTS_REDUCED] == 0


def test_bad_rank_is_dropped_and_a_mismatched_use_tells_every_rank(arena: SlotArena) -> None:
    agg = make(arena, world=2)
    assert contribute(agg, 2, np.ones(4, np.float32), source=where(2)) == []
    assert agg.counters[Counter.DROP_BAD_RANK] == 1
    contribute(agg, 0, np.ones(4, np.float32))
    notices = contribute(agg, 1, np.ones(8, np.float16))  # same bytes, other dtype
    assert agg.counters[Counter.DROP_MISMATCH] == 1
    assert sorted(n.dest for n in notices) == [where(0), where(1)]
    reason = bytes(notices[0].payload).decode()
    assert unpack(bytes(notices[0].header)).kind is Kind.DIVERGED
    assert "rank 1 sent round 1 offset 0 length 16 FLOAT16" in reason
    assert "rank 0 sent round 1 offset 0 length 16 FLOAT32" in reason


@pytest.mark.parametrize(("theirs", "cause"), [
    ({"op": Op.MAX}, "the ranks called allreduce with different ops"),
    ({"dtype": DType.FLOAT16}, "the ranks called allreduce on arrays of different dtypes"),
    ({"length": 12}, "the ranks called allreduce on arrays of different sizes"),
    ({"round_no": 2}, "a round was lost or skipped on some ranks, or they made different calls"),
])
def test_a_divergence_says_what_the_ranks_did_differently(
        arena: SlotArena, theirs: dict[str, Any], cause: str) -> None:
    """A user whose ranks called allreduce with another op, dtype or size was told "a round
    was lost or skipped on some ranks", and went looking for packet loss."""
    agg = make(arena, world=2)
    contribute(agg, 0, np.ones(4, np.float32))
    length = theirs.pop("length", 16)
    notices = contribute(agg, 1, np.ones(length // 4, np.float32), **theirs)
    assert agg.counters[Counter.DROP_MISMATCH] == 1
    assert f": {cause}; resynchronise the job" in bytes(notices[0].payload).decode()


def test_next_segment_before_slot_finished_is_refused(arena: SlotArena) -> None:
    agg = make(arena, world=2)
    contribute(agg, 0, np.ones(4, np.float32), offset=0)
    assert contribute(agg, 0, np.ones(4, np.float32), offset=4096, use=2) == []
    assert agg.counters[Counter.DROP_SLOT_BUSY] == 1
    # A newer round means the old one was abandoned by its workers: the slot is recycled.
    contribute(agg, 0, np.ones(4, np.float32), round_no=2, use=2)
    sends = contribute(agg, 1, np.ones(4, np.float32), round_no=2, use=2)
    assert np.array_equal(result_of(sends, np.float32), np.full(4, 2, np.float32))
    assert agg.counters[Counter.ABANDONED] == 1


def test_slot_budget_is_enforced(arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(JobSpec(1, 1, 2, 8), 0.0)
    with pytest.raises(AdmissionError, match="slots"):
        agg.add_job(JobSpec(2, 1, 2, 1), 0.0)
    agg.remove_job(1)
    agg.add_job(JobSpec(2, 1, 2, 1), 0.0)


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("op", list(Op))
def test_every_dtype_and_op_matches_reference(arena: SlotArena, dtype: DType, op: Op) -> None:
    rng = np.random.default_rng(int(dtype) * 10 + int(op))
    agg = make(arena, world=3, deterministic=True)
    xs = [random_values(rng, 200, dtype) for _ in range(3)]
    for r in (2, 0, 1):
        sends = contribute(agg, r, xs[r], op=op)
    got = result_of(sends, info(dtype).numpy)
    assert same_bits(got, reference(xs, op))


@settings(max_examples=40, deadline=None)
@given(st.permutations(range(6)), st.sampled_from(list(DType)), st.sampled_from(list(Op)))
def test_deterministic_mode_is_bitwise_identical_in_any_arrival_order(
    order: list[int], dtype: DType, op: Op
) -> None:
    rng = np.random.default_rng(42)
    xs = [random_values(rng, 96, dtype) for _ in range(6)]
    with SlotArena(capacity=2, max_payload=1024, rx_buffers=16) as arena:
        agg = make(arena, world=6, deterministic=True)
        for r in order:
            sends = contribute(agg, r, xs[r], op=op)
        got = result_of(sends, info(dtype).numpy)
        assert same_bits(got, reference(xs, op))
        assert arena.rx.free == len(arena.rx)  # every held buffer went back to the pool


def test_arrival_order_mode_is_exact_on_integer_values(arena: SlotArena) -> None:
    rng = np.random.default_rng(3)
    xs = [integer_valued(rng, 64, DType.BFLOAT16) for _ in range(4)]
    for order in itertools.islice(itertools.permutations(range(4)), 6):
        agg = make(arena, world=4)
        for r in order:
            sends = contribute(agg, r, xs[r])
        assert same_bits(result_of(sends, info(DType.BFLOAT16).numpy), reference(xs, Op.SUM))
        agg.remove_job(5)


def test_header_size_is_what_the_wire_says() -> None:
    assert HEADER_SIZE == 48


def test_abort_tells_bound_workers_and_answers_their_later_datagrams(arena: SlotArena) -> None:
    agg = make(arena, world=3)
    contribute(agg, 0, np.ones(4, np.float32))
    contribute(agg, 2, np.ones(4, np.float32))
    notices = agg.abort_job(5, "the appliance is shutting down")
    assert sorted(n.dest for n in notices) == [where(0), where(1), where(2)]
    assert all(unpack(bytes(n.header)).kind is Kind.ABORTED for n in notices)
    why = b"the appliance is shutting down"  # what each worker's JobAborted says
    assert all(bytes(n.payload) == why and unpack(bytes(n.header)).length == len(why)
               for n in notices)
    (late,) = contribute(agg, 1, np.ones(4, np.float32))
    assert unpack(bytes(late.header)).kind is Kind.ABORTED and late.dest == where(1)
    assert bytes(late.payload) == why
    assert contribute(agg, 1, np.ones(4, np.float32), cookie=7) == []  # not told to strangers
    # ... nor to another host that knows the cookie: notices go to bound endpoints only
    assert contribute(agg, 1, np.ones(4, np.float32), source=("198.18.0.99", 9001)) == []
    assert agg.counters[Counter.ABORT_NOTICES] == 4
    assert arena.free_slots == arena.capacity  # the job's slots are free again


def test_a_short_datagram_is_malformed_whatever_its_buffer_held_before(
        arena: SlotArena) -> None:
    agg = make(arena, world=2)
    heartbeat = heartbeat_of(0)
    assert feed(agg, [(heartbeat, where(0))])  # answered: LIVENESS
    # The same receive buffer comes back for the next datagram: its 10 bytes (or none) must
    # not borrow the heartbeat's header that still sits there.
    assert feed(agg, [(heartbeat[:10], where(0)), (b"", where(0))]) == []
    assert agg.counters[Counter.DROP_MALFORMED] == 2
    assert agg.counters[Counter.HEARTBEATS] == 1


def test_a_heartbeat_is_answered_with_the_silent_ranks_and_which_of_them_left(
        arena: SlotArena) -> None:
    """Rank 1 went quiet (a crash), rank 2 said it left (`departed`): past the liveness
    timeout both are named to rank 0, rank 2 as having left (its peers made more all_reduce
    calls than it did), so the worker can say which it was."""
    agg = make(arena, world=3)
    agg.update_job(replace(spec(3), departed=frozenset({2})), 0.0)
    heartbeat = heartbeat_of(0)
    (early,) = feed(agg, [(heartbeat, where(0))], now=4.0)
    assert unpack(bytes(early.header)).kind is Kind.LIVENESS and bytes(early.payload) == b""
    (answer,) = feed(agg, [(heartbeat, where(0))], now=6.0)
    assert unpack_silent(bytes(answer.payload)) == [
        SilentRank(1, where(1), 6.0), SilentRank(2, where(2), 6.0, left=True)]


def test_ranks_silent_together_through_an_outage_are_not_named_when_it_ends(
        arena: SlotArena) -> None:
    """A link flap or a switch reboot: every rank's heartbeats stop at once and come back.
    The first heartbeat through once got an answer naming the other ranks silent for the whole
    outage (their heartbeats still on their way), and their peers failed at once. Now the
    outage gives every rank a fresh timeout; a rank that stays silent is named one timeout
    later, and one silent while the others were heard is named as before."""
    agg = make(arena, world=3)
    for now in (0.5, 1.0):  # ranks 0 and 1 heartbeat; rank 2 died at 0.0
        for rank in (0, 1):
            feed(agg, [(heartbeat_of(rank), where(rank))], now=now)
    (after,) = feed(agg, [(heartbeat_of(0), where(0))], now=8.0)  # out from 1.0 to 8.0
    assert unpack_silent(bytes(after.payload)) == []  # rank 1's heartbeat is on its way
    assert agg.counters[Counter.JOB_OUTAGES] == 1
    feed(agg, [(heartbeat_of(1), where(1))], now=8.2)
    for now in (9.0, 10.0, 11.0, 12.0, 13.0, 13.5):
        (answer,) = feed(agg, [(heartbeat_of(0), where(0))], now=now)
        feed(agg, [(heartbeat_of(1), where(1))], now=now + 0.1)
    assert unpack_silent(bytes(answer.payload)) == [SilentRank(2, where(2), 5.5)]
    assert agg.counters[Counter.JOB_OUTAGES] == 1  # (1 s between heartbeats: no outage)


def test_a_rank_that_left_while_a_use_waits_for_it_is_named_at_once(arena: SlotArena) -> None:
    """Rank 2 left (a peer's Ctrl-C: its process group shut down) while slot 0's use still
    waits for its contribution, which will never come: its peers once learned it only past
    the liveness timeout, each rank's own shutdown waiting that long for a round that could not
    finish. Rank 1, silent as long but not gone, waits for the timeout as before; so does a
    departed rank no use waits for (its peers may still be taking their last results)."""
    agg = make(arena, world=3)
    agg.update_job(replace(spec(3), departed=frozenset({2})), 0.0)
    heartbeat = heartbeat_of(0)
    (idle,) = feed(agg, [(heartbeat, where(0))], now=0.5)
    assert unpack_silent(bytes(idle.payload)) == []  # nothing waits for it here
    contribute(agg, 0, np.ones(4, np.float32), now=0.6)
    (answer,) = feed(agg, [(heartbeat, where(0))], now=0.7)
    assert unpack_silent(bytes(answer.payload)) == [SilentRank(2, where(2), 0.7, left=True)]
    stats = agg.stats(5, 0.7)
    assert stats is not None and stats.silent == {2: 0.7} and set(stats.waiting) == {1, 2}
    assert stats.heard == {0: 0.0, 1: 0.7, 2: 0.7}  # (since the job came, for those unheard)


def test_a_ranks_datagrams_from_another_endpoint_are_dropped_and_named(
        arena: SlotArena) -> None:
    """A NAT between worker and appliance (a container on a bridged network) rewrites the
    source of the rank's datagrams: its own cookie, another endpoint. Dropped as before; the
    endpoint they came from is kept for status and the worker's diagnosis, until the rank
    joins again."""
    agg = make(arena, world=2)
    nat = ("10.0.0.5", 32768)
    assert contribute(agg, 1, np.ones(4, np.float32), source=nat) == []
    assert agg.counters[Counter.DROP_BAD_SOURCE] == 1
    assert contribute(agg, 1, np.ones(4, np.float32), cookie=7, source=("10.0.0.6", 1)) == []
    stats = agg.stats(5, 1.0)
    assert stats is not None and stats.elsewhere == {1: nat}  # (a stranger's cookie: not kept)
    agg.update_job(replace(spec(2), endpoints=(where(0), nat)), 2.0)  # re-joined from there
    stats = agg.stats(5, 2.0)
    assert stats is not None and stats.elsewhere == {}


def test_a_job_grows_quiet_only_while_no_rank_says_anything(arena: SlotArena) -> None:
    """The age the control plane evicts by: heartbeats count as much as contributions (a job
    of live workers between all_reduces is not quiet), and a stranger's datagram not at all."""
    agg = make(arena, world=2)  # added at t = 0
    assert agg.stats(5, 30.0).quiet_s == 30.0
    heartbeat = heartbeat_of(1)
    feed(agg, [(heartbeat, where(1))], now=40.0)
    stats = agg.stats(5, 45.0)
    assert stats.quiet_s == 5.0 and stats.last_activity is None  # no data yet, but heard
    feed(agg, [(heartbeat, ("198.18.0.99", 9001))], now=50.0)  # not a member
    assert agg.stats(5, 50.0).quiet_s == 10.0
    contribute(agg, 0, np.ones(4, np.float32), now=52.0)
    assert agg.stats(5, 53.0).quiet_s == 1.0


def test_an_abort_reason_is_cut_to_fit_a_datagram_on_a_character_boundary(
        arena: SlotArena) -> None:
    agg = make(arena, world=1)
    (notice,) = agg.abort_job(5, "é" * 400)  # 800 bytes of UTF-8
    assert bytes(notice.payload) == ("é" * 256).encode() and len(notice.payload) == 512
