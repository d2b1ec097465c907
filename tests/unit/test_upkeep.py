"""dataplane/upkeep.py through the aggregator: a heartbeat of a job the core does not have is
answered with UNKNOWN_JOB, echoing the heartbeat's header, within a budget per second; never
for a job the core has, or aborted (whose ranks hear ABORTED). And what an outage, as the
heartbeats show it, does to the ranks' liveness."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.upkeep import UNKNOWN_JOB_NOTICES_PER_S, Budget
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    DType,
    Header,
    Kind,
    Op,
    SilentRank,
    pack_into,
    unpack,
    unpack_silent,
)

from .feeding import feed
from .test_aggregator import COOKIE, KERNELS, contribute, spec, where


@pytest.fixture
def arena() -> Iterator[SlotArena]:
    with SlotArena(capacity=8, max_payload=1024, rx_buffers=32) as a:
        yield a


def beat(rank: int = 0, *, job: int = 5, cookie: int = COOKIE, epoch: int = 1,
         seq: int = 1) -> bytes:
    header = bytearray(HEADER_SIZE)
    pack_into(header, Header(Kind.HEARTBEAT, DType.FLOAT32, Op.SUM, 0, job, rank, cookie, seq,
                             0, 0, 0, 0, epoch))
    return bytes(header)


def test_a_restarted_cores_answer_to_a_heartbeat_of_a_job_it_lacks_echoes_it(
        arena: SlotArena) -> None:
    """A worker whose appliance restarted without its job learns it at its next heartbeat:
    the answer echoes the heartbeat's job, rank, cookie, epoch and number, and carries
    nothing more than it did (a stranger gains nothing by having it sent elsewhere)."""
    agg = Aggregator(arena, KERNELS, Counters())  # restarted: no jobs at all
    (notice,) = feed(agg, [(beat(2, epoch=3, seq=41), where(2))], now=1.0)
    h = unpack(bytes(notice.header))
    assert notice.dest == where(2) and bytes(notice.payload) == b""
    assert (h.kind, h.job_id, h.rank, h.cookie, h.epoch, h.round, h.length) == (
        Kind.UNKNOWN_JOB, 5, 2, COOKIE, 3, 41, 0)
    assert len(notice.header) + len(notice.payload) == HEADER_SIZE
    assert agg.counters[Counter.UNKNOWN_JOB_NOTICES] == 1
    assert agg.counters[Counter.DROP_UNKNOWN_JOB] == 1  # still counted as what it is


def test_a_job_of_that_number_with_another_cookie_is_not_the_workers(arena: SlotArena) -> None:
    """A restarted appliance numbers its jobs anew: its job 5 is someone else's."""
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(3), 0.0)
    (notice,) = feed(agg, [(beat(0, cookie=COOKIE + 1), where(0))])
    assert unpack(bytes(notice.header)).kind is Kind.UNKNOWN_JOB
    assert unpack(bytes(notice.header)).cookie == COOKIE + 1
    (liveness,) = feed(agg, [(beat(0), where(0))])  # the job's own rank: as ever
    assert unpack(bytes(liveness.header)).kind is Kind.LIVENESS
    assert agg.counters[Counter.UNKNOWN_JOB_NOTICES] == 1


def test_only_heartbeats_hear_it_and_an_aborted_jobs_ranks_hear_why(arena: SlotArena) -> None:
    """Contributions and path probes of a lost job are dropped as before (a worker heartbeats
    several times per timeout: one answer per heartbeat tells it); the ranks of a job aborted
    here hear ABORTED with its reason, not that the job is unknown."""
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(3), 0.0)
    agg.abort_job(5, "aborted by the operator")
    (told,) = feed(agg, [(beat(1), where(1))])
    assert unpack(bytes(told.header)).kind is Kind.ABORTED
    assert bytes(told.payload) == b"aborted by the operator"
    for kind in (Kind.CONTRIBUTION, Kind.QUERY, Kind.PATH_PROBE):
        other = bytearray(beat(0, job=6))
        other[3] = kind
        assert feed(agg, [(bytes(other), where(0))]) == [], kind
    (notice,) = feed(agg, [(beat(1, job=6), where(1))])
    assert unpack(bytes(notice.header)).kind is Kind.UNKNOWN_JOB
    assert agg.counters[Counter.UNKNOWN_JOB_NOTICES] == 1


def test_the_answers_are_bounded_per_second() -> None:
    budget = Budget(3)
    assert [budget.take(10.0), budget.take(10.2), budget.take(10.5), budget.take(10.9)] == [
        True, True, True, False]
    assert budget.take(11.0)  # a new second
    assert UNKNOWN_JOB_NOTICES_PER_S >= 500  # a large job's ranks hear it within a heartbeat


def test_a_flood_of_strangers_heartbeats_gets_no_more_than_the_budget(
        arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    sent = []
    for k in range(UNKNOWN_JOB_NOTICES_PER_S // 20 + 5):  # batches of 20 within one second
        sent += feed(agg, [(beat(0, job=j), where(0)) for j in range(20)], now=1.0 + k / 1e4)
    assert len(sent) == UNKNOWN_JOB_NOTICES_PER_S
    assert len(feed(agg, [(beat(0), where(0))] * 10, now=2.0)) == 10  # the next second
    assert agg.counters[Counter.UNKNOWN_JOB_NOTICES] == UNKNOWN_JOB_NOTICES_PER_S + 10


def silent_named(agg: Aggregator, rank: int, now: float) -> list[SilentRank]:
    (answer,) = feed(agg, [(beat(rank), where(rank))], now=now)
    assert unpack(bytes(answer.header)).kind is Kind.LIVENESS
    return unpack_silent(bytes(answer.payload))


@pytest.mark.parametrize("contribution_first", [False, True])
def test_a_rank_back_from_a_pause_hears_at_once_that_its_peers_died_meanwhile(
        arena: SlotArena, contribution_first: bool) -> None:
    """Rank 2's process paused (a swap storm, a debugger, a VM migrated) from 0.5 s; its peers
    heartbeat until 4.0 s, then die. As it comes back at 9.5 s it was told nothing for another
    timeout: every rank silent at once for half a timeout looked like a network outage, and
    each got a fresh timeout. But rank 2 fell silent long before the others: no outage. Its
    timers may send a contribution before its lease thread heartbeats (one run in ten did)."""
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(3), 0.0)
    feed(agg, [(beat(2), where(2))], now=0.5)
    for k in range(1, 9):
        for rank in (0, 1):
            feed(agg, [(beat(rank), where(rank))], now=k / 2)
    if contribution_first:
        contribute(agg, 2, np.ones(4, np.float32), now=9.4)
    assert silent_named(agg, 2, 9.5) == [SilentRank(0, where(0), 5.5),
                                         SilentRank(1, where(1), 5.5)]
    assert agg.counters[Counter.JOB_OUTAGES] == 0


def test_an_outage_gives_a_fresh_timeout_only_to_the_ranks_it_silenced(
        arena: SlotArena) -> None:
    """Rank 2 died at 0 s; ranks 0 and 1 heartbeat until the network fails at 4.0 s and come
    back at 10.0 s. Ranks 0 and 1 were silenced by the outage: fresh timeouts. Rank 2 was
    silent long before it: still named, its silence counted from its last word."""
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(3), 0.0)
    for k in range(1, 9):
        for rank in (0, 1):
            feed(agg, [(beat(rank), where(rank))], now=k / 2)
    assert silent_named(agg, 0, 10.0) == [SilentRank(2, where(2), 10.0)]
    assert agg.counters[Counter.JOB_OUTAGES] == 1
    named = {k / 2: silent_named(agg, 0, k / 2) for k in range(21, 32)}  # rank 1 never back
    assert named[15.0] == [SilentRank(2, where(2), 15.0)]
    # the longest silent first (wire.py: a LIVENESS names the most telling first)
    assert named[15.5] == [SilentRank(2, where(2), 15.5), SilentRank(1, where(1), 5.5)]
    assert agg.counters[Counter.JOB_OUTAGES] == 1
