"""Several rounds in flight at once (plugin/pipeline.py): lanes of slots, order, failures, and
exact results over the lossy in-memory network."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reduction_appliance.dataplane.errors import AllreduceTimeout, JobAborted, ReductionError
from reduction_appliance.dataplane.reduce import select_kernels
from reduction_appliance.dataplane.wire import WRAP, DType, Kind, Op, unpack
from reduction_appliance.deploy.testnet.reference import (
    integer_valued,
    random_values,
    reference,
    same_bits,
)
from reduction_appliance.plugin.congestion import Congestion
from reduction_appliance.plugin.pipeline import RoundPipeline, lane_endpoints
from reduction_appliance.plugin.rtt import RttEstimator, Timing
from reduction_appliance.plugin.session import Endpoint, Repairs

from .simnet import Faults, SimNet

KERNELS = select_kernels()


def endpoints(n: int = 2, slots: int = 4) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(("a", i), 1, 99, slots, f"appliance core {i}") for i in range(n))


def test_a_window_cap_below_the_slots_holds_every_core_even_with_fixed_windows() -> None:
    """A worker whose receive buffer holds fewer results than the slots (plugin/hostchecks.py)
    gets a window held there, whatever the congestion policy; one with room gets none."""
    for policy in (Congestion(), Congestion(enabled=False)):
        p = RoundPipeline(endpoints(2, 32), 0, 2, 64, RttEstimator(), congestion=policy,
                          window_cap=15)
        assert p.window is not None and p.window.limit == [15, 15] and p.window.shrunk
    assert RoundPipeline(endpoints(2, 32), 0, 2, 64, RttEstimator(),
                         congestion=Congestion(enabled=False), window_cap=None).window is None
    roomy = RoundPipeline(endpoints(2, 8), 0, 2, 64, RttEstimator(), window_cap=15,
                          congestion=Congestion(enabled=False))
    assert roomy.window is None  # 15 is more than the 8 slots: nothing to hold


@pytest.mark.parametrize(("slots", "lanes"), [(4, 1), (4, 2), (5, 2), (32, 3), (3, 3)])
def test_lanes_split_every_cores_slots_into_disjoint_ranges(slots: int, lanes: int) -> None:
    split = lane_endpoints(endpoints(2, slots), lanes)
    for core in range(2):
        used = [s for lane in split
                for s in range(lane[core].slot_base, lane[core].slot_base + lane[core].slots)]
        assert sorted(used) == list(range(slots))  # disjoint and covering
        assert all(lane[core].slots >= 1 for lane in split)


def test_more_lanes_than_slots_is_refused_with_the_fix() -> None:
    with pytest.raises(ReductionError, match=r"3 lanes need at least 3 slots.*jobs\.slots"):
        RoundPipeline(endpoints(2, 2), 0, 2, 64, RttEstimator(), lanes=3)


def test_rounds_overlap_in_their_own_slots_and_start_in_order() -> None:
    p = RoundPipeline(endpoints(1, 4), 0, 2, 64, RttEstimator(), lanes=2)
    first, second, third = (p.submit(DType.FLOAT32, Op.SUM, 2 * 64) for _ in range(3))
    sent = p.due(0.0)
    slots = {r: {t.header.slot for t in sent if t.header.round == r} for r in (first, second)}
    assert slots == {first: {2, 3}, second: {0, 1}}  # round r runs in lane r mod 2
    assert p.in_flight() == 2 and third not in {t.header.round for t in sent}
    # Round 3 shares round 1's lane: it waits for round 1 even though it is the only one left.
    for t in sent:
        if t.header.round == second:
            wanted = p.accept(t.header._replace(kind=Kind.RESULT))
            assert wanted is not None
            p.stored(*wanted, 0.001)
    assert [(o.ticket, o.error) for o in p.finished()] == [(second, None)]
    assert p.due(0.001) == [] and p.in_flight() == 1  # lane 0 is free, yet round 3 waits


def test_a_failure_for_good_ends_the_rounds_in_flight_and_every_later_one() -> None:
    """A path that narrowed under the job (plugin/pathprobe.PathWatch): the rounds in flight
    fail, and so does each round started later, at once and with the same words."""
    p = RoundPipeline(endpoints(1, 4), 0, 2, 64, RttEstimator())
    first = p.submit(DType.FLOAT32, Op.SUM, 64)
    p.due(0.0)
    assert p.quiet_since() == 0.0
    ended = p.fail_all(AllreduceTimeout("the path narrowed"), for_good=True)
    assert [(o.ticket, str(o.error)) for o in ended] == [(first, "the path narrowed")]
    assert p.quiet_since() is None  # no round in flight
    later = p.submit(DType.FLOAT32, Op.SUM, 64)
    assert p.due(1.0) == []
    (outcome,) = p.finished()
    assert outcome.ticket == later and type(outcome.error) is AllreduceTimeout
    assert str(outcome.error) == "the path narrowed" and outcome.error is not ended[0].error
    assert p.failed_by is ended[0].error  # the job's failure: the first, kept


def test_a_pipeline_whose_rounds_all_ended_well_has_no_failure_to_tell() -> None:
    """`failed_by` decides whether a worker on its way out leaves the job (plugin/client.py):
    not where a round failed, since the peers meet that failure themselves."""
    p = RoundPipeline(endpoints(1, 4), 0, 2, 64, RttEstimator())
    assert p.failed_by is None
    p.submit(DType.FLOAT32, Op.SUM, 64)
    p.due(0.0)
    assert p.failed_by is None  # in flight is not failed
    p.fail_all(JobAborted("gone"))
    assert isinstance(p.failed_by, JobAborted)


def test_an_empty_collective_ends_at_once_without_a_round() -> None:
    """Zero bytes (an empty tensor): done at the next turn, nothing sent, no round number
    used, so the rounds after it number alike on every rank. As a round it once waited for a
    last result that never comes, until its deadline."""
    p = RoundPipeline(endpoints(1, 4), 0, 2, 64, RttEstimator(), lanes=2)
    empty = p.submit(DType.FLOAT32, Op.SUM, 0)
    after = p.submit(DType.FLOAT32, Op.SUM, 64)
    assert p.wakeup() == 0.0
    sent = p.due(0.0)
    assert {t.header.round for t in sent} == {1} and len(sent) == 1  # the next one, round 1
    assert [(o.ticket, o.error) for o in p.finished()] == [(empty, None)]
    assert p.in_flight() == 1 and after != empty


@pytest.mark.parametrize(("nbytes", "rounds"), [
    (64, 1),  # one segment
    (4 * 64, 1),  # exactly one lane's window (2 cores x 2 slots): one round has it all
    (4 * 64 + 1, 2),  # one byte more: a round alone would need a second round trip
    (30 * 64, 4),  # wider than every lane's window together: one round per lane, no more
    (10**6, 4),
])
def test_a_collective_is_cut_into_rounds_of_about_one_lane_window(nbytes: int,
                                                                    rounds: int) -> None:
    """4 lanes of 2 cores x 2 slots: a lane's window is 4 segments. A collective gets as many
    rounds as it needs to have all its segments on the wire at once, up to every lane, so
    a small one on its own (DDP's last bucket) is not throttled to one lane's slots."""
    p = RoundPipeline(endpoints(2, 8), 0, 2, 64, RttEstimator(), lanes=4)
    assert p.lane_window == 4
    assert p.rounds_for(nbytes) == rounds
    # Slots that do not divide evenly: the narrowest lane decides (5 slots, 2 lanes: 2 and 3).
    uneven = RoundPipeline(endpoints(1, 5), 0, 2, 64, RttEstimator(), lanes=2)
    assert uneven.lane_window == 2 and uneven.rounds_for(3 * 64) == 2
    assert RoundPipeline(endpoints(2, 8), 0, 2, 64, RttEstimator()).rounds_for(10**6) == 1


class CountingEstimator(RttEstimator):
    """Records how many samples a round trip was said to bring, with each sample."""

    def __init__(self) -> None:
        super().__init__()
        self.per_rtt: list[int] = []

    def sample(self, dest: int, rtt: float, per_rtt: int = 1) -> None:
        self.per_rtt.append(per_rtt)
        super().sample(dest, rtt, per_rtt)


def test_rounds_of_several_lanes_share_the_in_flight_count_and_give_it_back() -> None:
    """Two rounds' segments are on the wire at once: each RTT sample counts both rounds'
    (4, not 2), and a round that ends unanswered takes its share out (a timeout here)."""
    rtt = CountingEstimator()
    p = RoundPipeline(endpoints(1, 4), 0, 2, 64, rtt, lanes=2)
    for _ in range(2):
        p.submit(DType.FLOAT32, Op.SUM, 2 * 64)
    sent = p.due(0.0)
    assert len(sent) == 4
    for t in sent[:3]:
        wanted = p.accept(t.header._replace(kind=Kind.RESULT))
        assert wanted is not None
        p.stored(*wanted, 0.001)
    assert rtt.per_rtt == [4, 3, 2]
    p.due(61.0)  # past the deadline: the round still waiting for one result fails
    assert [type(o.error) for o in p.finished()] == [type(None), AllreduceTimeout]
    p.submit(DType.FLOAT32, Op.SUM, 64)
    (t,) = p.due(61.0)
    wanted = p.accept(t.header._replace(kind=Kind.RESULT))
    assert wanted is not None
    p.stored(*wanted, 61.001)
    assert rtt.per_rtt[-1] == 1  # the failed round's unanswered segment is not counted


def test_an_abort_fails_rounds_in_flight_and_rounds_started_later() -> None:
    p = RoundPipeline(endpoints(2, 2), 0, 2, 64, RttEstimator(), lanes=2)
    rounds = [p.submit(DType.FLOAT32, Op.SUM, 256) for _ in range(3)]
    sent = p.due(0.0)
    p.on_aborted(sent[0].header._replace(kind=Kind.ABORTED, cookie=1))  # not our job
    assert p.due(0.001) == [] and p.finished() == []
    p.on_aborted(sent[0].header._replace(kind=Kind.ABORTED), reason="the operator aborted it")
    p.due(0.002)
    outcomes = p.finished()
    assert [o.ticket for o in outcomes] == rounds
    assert all(isinstance(o.error, JobAborted) for o in outcomes)
    assert all("(the operator aborted it)" in str(o.error) for o in outcomes)
    assert p.idle


def test_a_round_that_times_out_frees_its_lane_for_the_next() -> None:
    timing = Timing(0.01, 0.002, 0.05, deadline=1.0)
    p = RoundPipeline(endpoints(1, 2), 0, 2, 64, RttEstimator(timing), lanes=1)
    lost, nxt = p.submit(DType.FLOAT32, Op.SUM, 128), p.submit(DType.FLOAT32, Op.SUM, 64)
    p.due(0.0)
    sent = p.due(1.5)  # past the deadline: round 1 fails, round 2 starts at once
    (outcome,) = p.finished()
    assert outcome.ticket == lost and isinstance(outcome.error, AllreduceTimeout)
    assert {t.header.round for t in sent} == {nxt}
    wanted = p.accept(sent[0].header._replace(kind=Kind.RESULT))
    assert wanted is not None
    p.stored(*wanted, 1.6)
    assert [(o.ticket, o.error) for o in p.finished()] == [(nxt, None)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.integers(1, 4),
    cores=st.integers(1, 2),
    slots=st.integers(2, 6),
    lanes=st.integers(1, 4),
    sizes=st.lists(st.integers(1, 200), min_size=1, max_size=6),
    drop=st.sampled_from([0.0, 0.1, 0.3]),
    duplicate=st.sampled_from([0.0, 0.2]),
    max_delay=st.sampled_from([0.0, 0.002, 0.05]),
    deterministic=st.booleans(),
    dtype=st.sampled_from(list(DType)),
    op=st.sampled_from(list(Op)),
    seed=st.integers(0, 2**32 - 1),
    wrap_in=st.sampled_from([None, 1, 3]),
)
def test_concurrent_rounds_over_a_lossy_network_are_exact(
    world: int, cores: int, slots: int, lanes: int, sizes: list[int], drop: float,
    duplicate: float, max_delay: float, deterministic: bool, dtype: DType, op: Op, seed: int,
    wrap_in: int | None,
) -> None:
    """`wrap_in`: a fresh job, or one whose round and use numbers wrap a few rounds in."""
    lanes = min(lanes, slots)
    net = SimNet(KERNELS, world=world, cores=cores, slots=slots, deterministic=deterministic,
                 faults=Faults(drop, duplicate, max_delay, seed))
    rng = np.random.default_rng(seed)
    make = random_values if deterministic else integer_valued
    try:
        inputs = [[make(rng, n, dtype) for _ in range(world)] for n in sizes]
        batches = [[x.copy() for x in xs] for xs in inputs]
        outcomes, most = net.allreduce_many(batches, dtype, op, lanes, wrap_in=wrap_in)
        assert sorted((o.ticket, o.error) for o in outcomes) == [
            (i + 1, None) for i in range(len(sizes))]
        for xs, arrays in zip(inputs, batches, strict=True):
            want = reference(xs, op)
            for a in arrays:
                assert same_bits(a, want)
        assert most <= lanes
        if lanes > 1 and len(sizes) > 1:
            assert most >= 2  # submitted together, they really overlapped
        for agg in net.aggregators:
            stats = agg.stats(7, net.now)
            assert stats is not None and stats.waiting == {}
    finally:
        net.close()


def test_a_finished_round_says_what_sent_its_segments_again() -> None:
    """The outcome carries the round's retransmissions by what sent them (`Repairs`): here one
    timer that ran out, asking with a query, and none repaired otherwise."""
    timing = Timing(0.01, 0.002, 0.05, deadline=1.0)
    p = RoundPipeline(endpoints(1, 2), 0, 2, 64, RttEstimator(timing), lanes=1)
    ticket = p.submit(DType.FLOAT32, Op.SUM, 64)
    (sent,) = p.due(0.0)
    (asked,) = p.due(p.wakeup())  # its timer ran out: a query
    assert asked.header.kind is Kind.QUERY and asked.segment == sent.segment
    wanted = p.accept(sent.header._replace(kind=Kind.RESULT))
    assert wanted is not None
    p.stored(*wanted, 0.02)
    (outcome,) = p.finished()
    assert (outcome.ticket, outcome.error, outcome.retransmissions) == (ticket, None, 1)
    assert outcome.repairs == Repairs(overtaken=0, told=0, timer=1, queries=1)


@pytest.mark.parametrize("faults", [Faults(), Faults(0.1, 0.2, 0.01, seed=3)],
                         ids=["clean", "lossy"])
def test_round_and_use_numbers_wrap_where_a_long_job_passes_two_to_the_32(
        faults: Faults) -> None:
    """The header holds 32 bits of a round's and a slot use's number, and a long job passes
    them (a slot used 3,000 times a second does in 17 days). Past WRAP they start at 1 again
    on every rank and core alike, and the rounds across stay exact: before, the worker's next
    use could not be packed (OverflowError) and the appliance took 1 after WRAP for a use far
    ahead."""
    seen: set[tuple[int, int]] = set()

    def tap(source: Any, dest: Any, datagram: bytes) -> None:
        h = unpack(datagram)
        if h.kind is Kind.CONTRIBUTION:
            seen.add((h.round, h.use))

    net = SimNet(KERNELS, world=3, cores=2, slots=4, faults=faults, tap=tap)
    rng = np.random.default_rng(1)
    try:
        inputs = [[integer_valued(rng, n, DType.FLOAT32) for _ in range(3)]
                  for n in (700, 64, 300, 500)]
        batches = [[x.copy() for x in xs] for xs in inputs]
        outcomes, _ = net.allreduce_many(batches, DType.FLOAT32, Op.SUM, lanes=2, wrap_in=2)
        assert sorted((o.ticket, o.error) for o in outcomes) == [(i, None) for i in (1, 2, 3, 4)]
        for xs, arrays in zip(inputs, batches, strict=True):
            want = reference(xs, Op.SUM)
            assert all(same_bits(a, want) for a in arrays)
        assert {r for r, _ in seen} == {WRAP - 1, WRAP, 1, 2}
        uses = {u for _, u in seen}
        assert WRAP in uses and 1 in uses and max(u for u in uses if u < WRAP // 2) >= 2
    finally:
        net.close()
