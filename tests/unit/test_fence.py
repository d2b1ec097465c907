"""Draining a job (dataplane/fence.py through the aggregator, control/drain.py): the rounds
begun before the fence finish, contributions to later ones are dropped before they touch a
slot (one by one and in bursts), and the control plane aborts the job only once every core
fences it alike, nothing of it waits, and nothing of it came for a moment."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from reduction_appliance.control.drain import QUIET_S, Drain, Drained
from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import Fenced, Fences
from reduction_appliance.dataplane.wire import WRAP, Kind, unpack

from .feeding import feed
from .test_aggregator import KERNELS, contribute, heartbeat_of, make, query, spec, where
from .test_runs import as_run, build, contribution


@pytest.fixture
def arena() -> Iterator[SlotArena]:
    with SlotArena(capacity=8, max_payload=1024, rx_buffers=32) as a:
        yield a


def ones() -> np.ndarray:
    return np.ones(8, np.float32)


def test_the_rounds_begun_finish_and_no_later_one_begins(arena: SlotArena) -> None:
    agg = make(arena)  # three ranks, two slots
    contribute(agg, 0, ones(), round_no=1, slot=0, now=1.0)
    contribute(agg, 1, ones(), round_no=1, slot=0, now=1.0)
    assert agg.fence(5, 0, 2.0) == Fenced(1, 1, 1.0)  # round 1 begun, one segment waiting
    # A rank that finished round 1 begins round 2: dropped, its slot untouched.
    assert contribute(agg, 0, ones(), round_no=2, slot=1, now=2.1) == []
    assert agg.counters[Counter.DROP_FENCED] == 1
    assert agg.fence(5, 0, 2.1) == Fenced(1, 1, pytest.approx(1.1))  # not heard as round 1
    # Round 1's other segments, even one that had not begun, and its last rank go on.
    contribute(agg, 1, ones(), round_no=1, slot=1, offset=32, now=2.2)
    (result,) = contribute(agg, 2, ones(), round_no=1, slot=0, now=2.3)
    assert unpack(bytes(result.header)).kind is Kind.RESULT
    assert np.all(np.frombuffer(bytes(result.payload), np.float32) == 3.0)
    assert agg.fence(5, 0, 2.3) == Fenced(1, 1, pytest.approx(0.0))  # slot 1 waits still
    # A worker that lost the result asks again: it hears it, and that counts as heard.
    (resent,) = query(agg, 0, slot=0, use=1, length=32, now=3.0)
    assert unpack(bytes(resent.header)).kind is Kind.RESULT
    assert agg.fence(5, 0, 3.5).quiet_s == pytest.approx(0.5)
    assert agg.counters[Counter.DROP_FENCED] == 1
    assert agg.counters[Counter.DROP_MISMATCH] == 0


def test_an_idle_job_is_quiet_at_once_and_lets_no_round_begin(arena: SlotArena) -> None:
    agg = make(arena)
    assert agg.fence(5, 0, 1.0) == Fenced(0, 0, math.inf)
    assert contribute(agg, 0, ones(), round_no=1, now=1.0) == []
    assert agg.counters[Counter.DROP_FENCED] == 1
    assert agg.fence(6, 0, 1.0) is None  # a job this core lacks


def test_a_floor_from_another_core_raises_the_fence_and_never_lowers_it(
        arena: SlotArena) -> None:
    agg = make(arena)
    contribute(agg, 0, ones(), round_no=2, now=1.0)
    assert agg.fence(5, 0, 1.0).fence == 2
    assert agg.fence(5, 4, 1.0).fence == 4  # another core had begun round 4
    assert agg.fence(5, 3, 1.0).fence == 4
    contribute(agg, 0, ones(), round_no=4, slot=1, now=1.1)  # up to the fence: begins
    assert agg.counters[Counter.DROP_FENCED] == 0
    contribute(agg, 1, ones(), round_no=5, slot=1, now=1.1)
    assert agg.counters[Counter.DROP_FENCED] == 1


def test_round_numbers_wrap_across_the_fence(arena: SlotArena) -> None:
    agg = make(arena)
    contribute(agg, 0, ones(), round_no=WRAP - 1, now=1.0)
    assert agg.fence(5, 0, 1.0).fence == WRAP - 1
    contribute(agg, 1, ones(), round_no=WRAP - 1, now=1.0)  # the fence's own round
    contribute(agg, 1, ones(), round_no=1, slot=1, now=1.0)  # two rounds on, past the wrap
    assert agg.counters[Counter.DROP_FENCED] == 1
    assert agg.fence(5, 2, 1.0).fence == 2  # a floor past the wrap is newer


def test_a_fenced_jobs_bursts_go_one_by_one_and_stop_at_the_fence() -> None:
    arena, agg = build()  # jobs 5 to 8, eight slots each
    with arena:
        run = [contribution(5, 0, s, 1, round_no=1) for s in range(4)]
        agg.on_batch(as_run(run, where(0)), 1.0)
        assert agg.counters[Counter.RUNS_TAKEN] == 1
        assert agg.fence(5, 0, 1.0).fence == 1
        later = [contribution(5, 1, s, 1, round_no=2) for s in range(4, 8)]
        assert agg.on_batch(as_run(later, where(1)), 1.1) == []
        same = [contribution(5, 1, s, 1, round_no=1) for s in range(4)]
        agg.on_batch(as_run(same, where(1)), 1.2)
        counters = agg.counters
        assert counters[Counter.RUNS_TAKEN] == 1  # neither burst taken whole
        assert counters[Counter.DECLINED_DATAGRAMS] == 8
        assert counters[Counter.DROP_FENCED] == 4
        assert agg.fence(5, 0, 1.2) == Fenced(1, 4, pytest.approx(0.0))  # rank 2 to come
        assert agg.on_batch(as_run([contribution(6, 0, 0, 1, round_no=9)], where(0)), 1.2) \
            == []  # another job drains only when told
        assert counters[Counter.DROP_FENCED] == 4


def test_segments_that_wait_for_a_rank_that_never_joined_or_left_are_stuck_on_it(
        arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(replace(spec(), endpoints=(where(0), where(1), None)), 0.0)  # rank 2 not in
    contribute(agg, 0, ones(), round_no=1, slot=0, now=1.0)
    contribute(agg, 1, ones(), round_no=1, slot=0, now=1.0)
    assert agg.fence(5, 0, 1.0) == Fenced(1, 1, 0.0, (2,))
    agg.update_job(replace(spec(), departed=frozenset({1})), 1.0)  # rank 2 joined, 1 left
    assert agg.fence(5, 0, 1.0).stuck_on == ()  # rank 1 is in: it waits for rank 2 only
    contribute(agg, 0, ones(), round_no=1, slot=1, offset=32, now=1.1)
    assert agg.fence(5, 0, 1.1).stuck_on == ()  # one stuck on rank 1, the other can finish


def test_segments_that_wait_for_a_rank_found_ended_are_stuck_on_it_on_every_core(
        arena: SlotArena) -> None:
    """Only the core the job's heartbeats come to finds a rank ended (dataplane.reach); it
    says so, and every core is told with the next FenceJobs."""
    agg = make(arena)
    feed(agg, [(heartbeat_of(r), where(r)) for r in range(3)], 0.0)  # (the heartbeats' core)
    contribute(agg, 0, ones(), round_no=1, slot=0, now=1.0)
    contribute(agg, 1, ones(), round_no=1, slot=0, now=1.0)
    assert agg.fence(5, 0, 1.0).stuck_on == ()  # rank 2 may still come
    assert agg.fence(5, 0, 1.0, frozenset({2})) == Fenced(1, 1, 0.0, (2,))  # another core's
    (reach,) = agg.reach([], 1.0)  # its heartbeats stopped
    agg.reach([reach.dest], 1.1)  # and its host said its port is closed
    assert agg.fence(5, 0, 1.2) == Fenced(1, 1, pytest.approx(0.2), (2,), (2,))


# ---- control/drain.py: when the control plane may abort ----

def fences(job: int, *views: Fenced | None) -> list[Fences]:
    return [Fences({job: v}) for v in views]


def test_a_job_drains_when_every_core_fences_it_alike_and_it_is_done_and_quiet() -> None:
    drain = Drain((5,))
    assert drain.floors() == ((5, 0),)
    # Core 1 had begun round 8 when core 0 answered with 7: both must let round 8 finish.
    assert drain.take(fences(5, Fenced(7, 0, 9.0), Fenced(8, 0, 9.0))) == {}
    assert drain.floors() == ((5, 8),)
    assert drain.take(fences(5, Fenced(8, 1, 9.0), Fenced(8, 0, 9.0))) == {}  # one waits
    assert drain.take(fences(5, Fenced(8, 0, QUIET_S / 2), Fenced(8, 0, 9.0))) == {}
    assert drain.take(fences(5, Fenced(8, 0, QUIET_S), Fenced(8, 0, 9.0))) == {5: Drained(8)}
    assert drain.pending == {} and drain.floors() == ()


def test_a_job_whose_waiting_segments_are_stuck_on_every_core_drains_at_once() -> None:
    drain = Drain((5,))
    stuck, free = Fenced(3, 2, 0.0, (2,)), Fenced(3, 1, 0.0)
    assert drain.take(fences(5, stuck, free)) == {}  # core 1's segment may still finish
    assert drain.take(fences(5, stuck, Fenced(3, 0, 0.0), Fenced(3, 1, 0.0, (4,)))) == {
        5: Drained(3, (2, 4))}


def test_a_rank_one_core_found_ended_is_passed_on_and_the_job_drains_once_all_agree() -> None:
    drain = Drain((5, 6))
    found, unaware = Fenced(3, 1, 0.0, (2,), (2,)), Fenced(3, 1, 0.0)
    assert drain.take([Fences({5: found, 6: Fenced(4, 1, 0.0)}),
                       Fences({5: unaware, 6: Fenced(4, 1, 0.0)})]) == {}
    assert drain.ended() == ((5, (2,)),)  # for every core, with the next FenceJobs
    told = Fenced(3, 1, 0.0, (2,))
    drained = drain.take([Fences({5: found, 6: Fenced(4, 1, 0.0)}),
                          Fences({5: told, 6: Fenced(4, 1, 0.0)})])
    assert drained == {5: Drained(3, (2,))}, drained  # job 6 still waits
    assert "or ended (its process gone)" in drained[5].why()
    assert drain.ended() == ()  # (job 5 is drained; job 6 has none)


def test_an_idle_job_a_lost_one_and_a_wrapped_fence_drain() -> None:
    drain = Drain((5, 6, 7))
    replies = [Fences({5: Fenced(0, 0, math.inf), 6: None, 7: Fenced(WRAP - 1, 0, 1.0)}),
               Fences({5: Fenced(0, 0, math.inf), 6: None, 7: Fenced(2, 0, 1.0)})]
    assert drain.take(replies) == {5: Drained(0), 6: Drained(0)}  # idle; on no core
    assert drain.pending == {7: 2}  # round 2 is past WRAP - 1
    assert drain.take([Fences({7: Fenced(2, 0, 1.0)})] * 2) == {7: Drained(2)}
