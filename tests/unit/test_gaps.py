"""Lost contributions found by their numbers (dataplane/gaps.py, plugin SendOrder): the core
tells the rank at once (MISSING), the rank resends them, and nothing else is told."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from reduction_appliance.dataplane.aggregator import Aggregator
from reduction_appliance.dataplane.counters import Counter, Counters
from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.slots import SlotArena
from reduction_appliance.dataplane.spec import JobSpec
from reduction_appliance.dataplane.transport import Address, RxBatch
from reduction_appliance.dataplane.wire import (
    HEADER_SIZE,
    DType,
    Flags,
    Header,
    Kind,
    Op,
    pack_into,
    unpack,
)
from reduction_appliance.deploy.testnet.reference import reference, same_bits
from reduction_appliance.plugin.pipeline import RoundPipeline
from reduction_appliance.plugin.rtt import RttEstimator
from reduction_appliance.plugin.session import Endpoint

from .simnet import Faults, SimNet
from .test_runs import COOKIE, GROUP, SLOTS, WORLD, contribution, pair, sent, take_both, where

__all__ = ["pair"]  # the fixture, shared with test_runs


def missing_notes(sent: list[tuple[Address, bytes, bytes]]) -> list[tuple[Address, int, bytes]]:
    """(destination, rank, numbers) of each MISSING among `sent` (destination, header,
    payload)."""
    found = []
    for dest, header, payload in sent:
        h = unpack(header)
        if h.kind is Kind.MISSING:
            found.append((dest, h.rank, payload))
    return found


def test_skipped_numbers_are_told_to_their_rank_at_once_on_either_path(
        pair: tuple[Aggregator, Aggregator]) -> None:
    a, b = pair
    run = [contribution(5, 0, s, 1, sequence=n) for s, n in zip(range(4), (0, 1, 4, 5),
                                                                 strict=True)]
    out = take_both(a, b, run, where(0))  # asserts the burst and one-by-one paths agree
    assert missing_notes(out) == [(where(0), 0, bytes([2, 3]))]
    assert a.counters.cells[Counter.CONTRIBUTIONS_MISSED] == 2
    for agg in (a, b):  # and the job's status says whose they were
        stats = agg.stats(5, 0.0)
        assert stats is not None and stats.missed_from == {0: 2} and stats.lost_to == {}


def test_late_retransmitted_and_queried_contributions_tell_nothing(
        pair: tuple[Aggregator, Aggregator]) -> None:
    a, b = pair
    take_both(a, b, [contribution(5, 1, 0, 1, sequence=10),
                     contribution(5, 1, 1, 1, sequence=11)], where(1))
    quiet = [
        [contribution(5, 1, 2, 1, sequence=9)],  # late: behind the next expected (12)
        [contribution(5, 1, 3, 1, sequence=200, flags=Flags.RETRANSMIT)],  # not numbered
        [contribution(5, 1, 4, 1, kind=Kind.QUERY)],
        [contribution(5, 1, 5, 1, sequence=12)],  # the next expected: still 12
    ]
    for run in quiet:
        assert missing_notes(take_both(a, b, run, where(1))) == []
    assert a.counters.cells[Counter.CONTRIBUTIONS_MISSED] == 0


def sent_query(rank: int, slot: int, newest: int, payload: bytes | None = None) -> bytes:
    """A QUERY naming its sender's newest send number (Flags.SENT), or another payload."""
    head = contribution(5, rank, slot, 1, kind=Kind.QUERY, flags=Flags.RETRANSMIT | Flags.SENT)
    return head + (bytes([newest]) if payload is None else payload)


def test_a_query_naming_the_newest_number_tells_the_gap_at_the_end(
        pair: tuple[Aggregator, Aggregator]) -> None:
    """The last contributions before a pause show no jump; the query's number does."""
    a, b = pair
    take_both(a, b, [contribution(5, 2, s, 1, sequence=n) for s, n in ((0, 40), (1, 41))],
              where(2))
    # 42 and 43 never came: the query says 43 left, so both are told at once.
    assert missing_notes(take_both(a, b, [sent_query(2, 0, 43)], where(2))) == [
        (where(2), 2, bytes([42, 43]))]
    # Told once: the same query again, and one naming a number seen, tell nothing.
    assert missing_notes(take_both(a, b, [sent_query(2, 0, 43)], where(2))) == []
    assert missing_notes(take_both(a, b, [sent_query(2, 1, 41)], where(2))) == []
    # The count goes on after the told numbers: 44 is the next expected.
    assert missing_notes(take_both(a, b, [contribution(5, 2, 2, 1, sequence=44)],
                                   where(2))) == []
    assert a.counters.cells[Counter.CONTRIBUTIONS_MISSED] == 2


def test_a_query_whose_number_is_not_one_byte_tells_nothing(
        pair: tuple[Aggregator, Aggregator]) -> None:
    """Two bytes are malformed (dropped, counted); none is a query without the number."""
    a, b = pair
    take_both(a, b, [contribution(5, 1, 0, 1, sequence=7)], where(1))
    assert take_both(a, b, [sent_query(1, 0, 9, b"\x09\x0a")], where(1)) == []
    assert a.counters.cells[Counter.DROP_BAD_LENGTH] == 1
    assert missing_notes(take_both(a, b, [sent_query(1, 0, 9, b"")], where(1))) == []
    assert a.counters.cells[Counter.DROP_BAD_LENGTH] == 1
    assert a.counters.cells[Counter.CONTRIBUTIONS_MISSED] == 0


def test_a_rejoined_rank_and_a_new_epoch_start_the_count_afresh() -> None:
    arena = SlotArena(capacity=SLOTS, max_payload=64, rx_buffers=256)
    agg = Aggregator(arena, select_kernels("numpy"), Counters())
    endpoints = tuple(where(r) for r in range(WORLD))
    spec = JobSpec(5, COOKIE, WORLD, SLOTS, False, GROUP, epoch=1, endpoints=endpoints)
    try:
        agg.add_job(spec, 0.0)

        def send(rank: int, slot: int, sequence: int, epoch: int,
                 source: Address) -> list[tuple[Address, int, bytes]]:
            buf = bytearray(HEADER_SIZE)
            pack_into(buf, Header(Kind.CONTRIBUTION, DType.FLOAT32, Op.SUM, 0, 5, rank, COOKIE,
                                  1, slot, slot * 64, 64, 1, epoch, sequence))
            index = agg.pool.take()
            agg.pool.views[index][:HEADER_SIZE + 64] = bytes(buf) + bytes(64)
            batch = RxBatch()
            batch.add(index, HEADER_SIZE + 64, source)
            return missing_notes(sent(agg.on_batch(batch, 1.0)))

        assert send(0, 0, 30, 1, where(0)) == []
        moved = ("198.18.0.99", 9100)  # rank 0 rejoins from elsewhere: it numbers afresh
        agg.update_job(JobSpec(5, COOKIE, WORLD, SLOTS, False, GROUP, epoch=1,
                               endpoints=(moved, *endpoints[1:])), 2.0)
        assert send(0, 1, 3, 1, moved) == []
        assert send(0, 2, 5, 1, moved) == [(moved, 0, bytes([4]))]  # counted from 3 now
        assert send(1, 0, 77, 1, where(1)) == []
        agg.update_job(JobSpec(5, COOKIE, WORLD, SLOTS, False, GROUP, epoch=2,
                               endpoints=(moved, *endpoints[1:])), 3.0)
        assert send(1, 0, 0, 2, where(1)) == []  # 0 after 77: a new epoch, not a gap
    finally:
        arena.close()


def core(i: int) -> Endpoint:
    return Endpoint(("a", i), 1, 99, 4, f"appliance core {i}")


def missing(numbers: bytes, *, rank: int = 0, epoch: int = 1) -> Header:
    return Header(Kind.MISSING, DType.FLOAT32, Op.SUM, 0, 1, rank, 99, 0, 0, 0, len(numbers),
                  0, epoch)


def test_a_rank_resends_the_contributions_a_core_names_at_once_and_nothing_else() -> None:
    p = RoundPipeline((core(0), core(1)), 0, 2, 64, RttEstimator(), lanes=1)
    p.submit(DType.FLOAT32, Op.SUM, 8 * 64)
    first = p.due(0.0)
    numbers = {(t.endpoint, t.header.serial): t.segment for t in first}
    assert sorted(numbers) == [(e, n) for e in (0, 1) for n in range(4)]  # per core, in order
    # Core 1's numbers 1 and 2 never came; its answer for number 2 did meanwhile.
    answered = next(t for t in first if (t.endpoint, t.header.serial) == (1, 2))
    wanted = p.accept(answered.header._replace(kind=Kind.RESULT), ("a", 1))
    assert wanted is not None
    p.stored(*wanted, 0.001)
    p.on_missing(missing(bytes([1, 2])), bytes([1, 2]), ("a", 1))
    p.on_missing(missing(bytes([1]), rank=1), bytes([1]), ("a", 1))  # another rank's
    p.on_missing(missing(bytes([3])), bytes([3]), ("elsewhere", 1))  # not our core
    p.on_missing(missing(bytes([0]), epoch=2), bytes([0]), ("a", 1))  # another epoch
    again = p.due(0.002)
    assert [(t.segment, t.header.kind, bool(t.header.flags & Flags.RETRANSMIT))
            for t in again] == [(numbers[(1, 1)], Kind.CONTRIBUTION, True)]
    assert p.due(0.002) == []  # told once, resent once


@pytest.mark.parametrize("seed", range(4))
def test_over_a_lossy_in_order_network_lost_contributions_are_told_and_resent(
        seed: int) -> None:
    net = SimNet(select_kernels(), world=4, cores=2, slots=8, max_payload=256,
                 faults=Faults(drop=0.03, max_delay=0.0, seed=seed))
    dropped = 0
    passes = net.net.faults

    def count(source: Address, dest: Address, datagram: bytes) -> Sequence[float]:
        nonlocal dropped
        copies = passes(source, dest, datagram)
        h = unpack(datagram)
        if not copies and h.kind is Kind.CONTRIBUTION and not h.flags & Flags.RETRANSMIT:
            dropped += 1
        return copies

    net.net.faults = count
    rng = np.random.default_rng(seed)
    try:
        for _ in range(3):
            arrays = [rng.integers(-8, 8, 256 * 32).astype(np.float32) for _ in range(4)]
            want = reference([a.copy() for a in arrays], Op.SUM)
            rounds = net.allreduce(arrays, DType.FLOAT32, Op.SUM)
            assert all(same_bits(a, want) for a in arrays)
        told = sum(int(a.counters.cells[Counter.CONTRIBUTIONS_MISSED]) for a in net.aggregators)
        # Every number told was really lost (the network keeps each path's order); a loss
        # with nothing sent after it on that core is found by the timers instead.
        assert 0 < told <= dropped
        assert sum(r.nudged_retransmissions for r in rounds) > 0
    finally:
        net.close()
