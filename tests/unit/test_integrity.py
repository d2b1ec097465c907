"""Integrity and isolation at the aggregator: forged, stale, out-of-window and duplicated
datagrams never change a sum or wedge a job; one job cannot starve another (sans-I/O)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.errors import AdmissionError
from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import JobSpec
from reduction_appliance.dataplane.transport import Send
from reduction_appliance.dataplane.wire import Kind, unpack

from .test_aggregator import COOKIE, GROUP, contribute, result_of, spec, where

KERNELS = select_kernels("numpy")
STRANGER = ("198.18.0.66", 9001)


@pytest.fixture
def arena() -> Iterator[SlotArena]:
    with SlotArena(capacity=8, max_payload=1024, rx_buffers=128) as a:
        yield a


def kinds(sends: list[Send]) -> list[Kind]:
    return [unpack(bytes(s.header)).kind for s in sends]


def test_contributions_from_another_source_are_dropped_and_counted(arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(world=2), 0.0)
    contribute(agg, 0, np.ones(4, np.float32))
    # Another host, with the right cookie, claims rank 1: dropped, never summed.
    assert contribute(agg, 1, np.full(4, 1000, np.float32), source=STRANGER) == []
    assert contribute(agg, 1, np.full(4, 1000, np.float32), source=(where(1)[0], 1)) == []
    assert agg.counters[Counter.DROP_BAD_SOURCE] == 2
    sends = contribute(agg, 1, np.ones(4, np.float32))
    assert np.array_equal(result_of(sends, np.float32), np.full(4, 2, np.float32))


def test_unicast_results_go_to_bound_endpoints_whatever_datagrams_say(arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(world=2, multicast=False), 0.0)
    for _ in range(5):  # forged, even with the cookie: cannot re-point a rank's results
        contribute(agg, 1, np.ones(4, np.float32), source=STRANGER)
        contribute(agg, 1, np.ones(4, np.float32), source=STRANGER, round_no=9, use=2)
    contribute(agg, 0, np.ones(4, np.float32))
    sends = contribute(agg, 1, np.ones(4, np.float32))
    assert sorted(s.dest for s in sends) == [where(0), where(1)]


def test_a_flood_far_ahead_of_the_window_never_occupies_a_slot(arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(world=2), 0.0)
    for slot in range(2):  # 64 datagrams, as in the report: one per slot and use
        for use in (3, 7, 2**31, 2**32 - 1):
            for rnd in (2**32 - 1, 1):
                assert contribute(agg, 0, np.ones(4, np.float32), slot=slot, use=use,
                                  round_no=rnd) == []
                assert contribute(agg, 1, np.ones(4, np.float32), slot=slot, use=use,
                                  round_no=rnd, source=STRANGER) == []
    assert agg.counters[Counter.DROP_WINDOW] == 2 * 4 * 2
    # The job keeps working: every slot takes its real next use.
    for slot in range(2):
        contribute(agg, 0, np.full(4, 2, np.float32), slot=slot)
        sends = contribute(agg, 1, np.full(4, 3, np.float32), slot=slot)
        assert np.array_equal(result_of(sends, np.float32), np.full(4, 5, np.float32))


def test_a_new_epoch_resets_every_slot_and_answers_stale_datagrams_with_resync(
        arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(world=2), 0.0)
    contribute(agg, 0, np.ones(4, np.float32))  # round 1 half done when rank 1 restarts
    moved = (*spec(world=2).endpoints[:1], (where(1)[0], 40777))
    notices = agg.update_job(replace(spec(world=2), epoch=2, endpoints=moved), 0.0)
    assert sorted(n.dest for n in notices) == [where(0), moved[1]]
    assert all(unpack(bytes(n.header)).kind is Kind.RESYNC and
               unpack(bytes(n.header)).epoch == 2 for n in notices)
    (told,) = contribute(agg, 0, np.ones(4, np.float32), use=2)  # still in epoch 1
    assert unpack(bytes(told.header)).kind is Kind.RESYNC and told.dest == where(0)
    assert contribute(agg, 1, np.ones(4, np.float32), epoch=2) == []  # the retired endpoint
    assert agg.counters[Counter.DROP_EPOCH] == 1
    assert agg.counters[Counter.DROP_BAD_SOURCE] == 1
    # Epoch 2 starts from use 1 with nothing left of epoch 1's partial sum.
    contribute(agg, 0, np.full(4, 7, np.float32), epoch=2)
    sends = contribute(agg, 1, np.full(4, 1, np.float32), epoch=2, source=moved[1])
    assert np.array_equal(result_of(sends, np.float32), np.full(4, 8, np.float32))


def test_diverged_ranks_are_all_told_until_a_new_epoch(arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(spec(world=3), 0.0)
    contribute(agg, 0, np.ones(4, np.float32), round_no=4)
    told = contribute(agg, 2, np.ones(4, np.float32), round_no=5)  # a round lost at rank 2
    assert kinds(told) == [Kind.DIVERGED] * 3 and sorted(s.dest for s in told) == [
        where(0), where(1), where(2)]
    reason = bytes(told[0].payload).decode()
    assert "slot 0 use 1" in reason and "rank 2 sent round 5" in reason
    assert "rank 0 sent round 4" in reason
    stats = agg.stats(5, 0.0)
    assert stats is not None and stats.diverged == reason
    (again,) = contribute(agg, 1, np.ones(4, np.float32), round_no=4)  # everyone hears it
    assert kinds([again]) == [Kind.DIVERGED] and again.dest == where(1)
    agg.update_job(replace(spec(world=3), epoch=2), 0.0)
    for rank in range(2):
        assert contribute(agg, rank, np.ones(4, np.float32), epoch=2) == []
    sends = contribute(agg, 2, np.ones(4, np.float32), epoch=2)
    assert np.array_equal(result_of(sends, np.float32), np.full(4, 3, np.float32))


def test_a_deterministic_job_holds_only_its_quota_and_cannot_starve_another(
        arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    greedy = replace(spec(world=4, deterministic=True, job=5), hold_buffers=3)
    other = replace(spec(world=4, deterministic=True, job=6), hold_buffers=3)
    agg.add_job(greedy, 0.0)
    agg.add_job(other, 0.0)
    # The greedy job's ranks 1..3 run ahead on both slots: 6 early contributions, quota 3.
    for slot in range(2):
        for rank in (3, 2, 1):
            contribute(agg, rank, np.ones(4, np.float32), slot=slot, job=5)
    assert agg.counters[Counter.DROP_NO_BUFFER] == 3
    # The other job still holds and finishes in rank order.
    for rank in (3, 1, 2):
        assert contribute(agg, rank, np.full(4, rank, np.float32), job=6) == []
    sends = contribute(agg, 0, np.full(4, 10, np.float32), job=6)
    assert np.array_equal(result_of(sends, np.float32), np.full(4, 16, np.float32))
    # Admission refuses what the pool cannot reserve, saying how much is left.
    with pytest.raises(AdmissionError, match="held receive buffers but only 58"):
        agg.add_job(replace(spec(world=2, deterministic=True, job=7), hold_buffers=100), 0.0)


def test_notices_of_an_aborted_job_go_to_its_bound_endpoints_only(arena: SlotArena) -> None:
    agg = Aggregator(arena, KERNELS, Counters())
    agg.add_job(JobSpec(9, COOKIE, 2, 2, multicast=GROUP, endpoints=(where(0), where(1))), 0.0)
    agg.abort_job(9)
    assert contribute(agg, 0, np.ones(4, np.float32), job=9, source=STRANGER) == []
    (told,) = contribute(agg, 0, np.ones(4, np.float32), job=9)
    assert told.dest == where(0) and kinds([told]) == [Kind.ABORTED]
